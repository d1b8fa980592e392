"""``python -m fedagent_flwr.trainers.reference train|evaluate JOB.json`` (or ``serve CHANNEL_DIR``)."""

import sys

from fedagent_flwr.trainers.reference.cli import main

if __name__ == "__main__":
    sys.exit(main())
