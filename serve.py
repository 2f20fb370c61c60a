"""Serve a K3 model: stream a completion to the terminal, or run an OpenAI-compatible HTTP server.

The program is :mod:`k3_jax.cli.serve` (installed as the console script ``k3-serve``); ``python serve.py --help``
lists its options.
"""

import sys

from k3_jax.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
