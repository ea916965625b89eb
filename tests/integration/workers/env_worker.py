"""Print the rendezvous environment Paddle's launcher gave this rank, as one JSON line."""

from __future__ import annotations

import json
import os

KEYS = ("PADDLE_MASTER", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT", "PORT_RANGE")

if __name__ == "__main__":
    print("ENV " + json.dumps({k: os.environ.get(k, "") for k in KEYS}), flush=True)
