"""What both trainer backends share: the checks every TrainJob/EvalJob goes through
(:mod:`.checks`), client rules and the built-in FedProx rule (:mod:`.client_rule`,
:mod:`.fedprox`), seeding (:mod:`.seeds`), the batched Hugging Face sampler (:mod:`.sampler`) and
the Hugging Face evaluator (:mod:`.evaluator`) that both backends evaluate with, and the optimiser
state a persistent trainer keeps across a client's rounds (:mod:`.optimizer_state`)."""
