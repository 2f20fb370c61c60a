"""Train a K3 model: ``python train.py`` trains ``configs/k3-tiny.json`` on the bundled corpus (CPU, minutes).

The program is :mod:`k3_jax.cli.train` (installed as the console script ``k3-train``); ``python train.py --help``
lists its options.
"""

import sys

from k3_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
