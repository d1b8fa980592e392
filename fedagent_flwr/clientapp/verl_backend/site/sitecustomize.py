"""Put on a verl job's PYTHONPATH by the fedagent-flwr entry module: arms the FedProx hook in every
process of the job (driver and Ray workers) when FEDAGENT_FEDPROX_MU is set; does nothing otherwise."""

from fedagent_flwr.clientapp.verl_backend.fedprox import install_from_environment

install_from_environment()
