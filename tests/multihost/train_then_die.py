"""``train.py`` in which process ``$K3_DIE_PROCESS`` SIGKILLs itself right after training step ``$K3_DIE_AFTER_STEP``.

Test support for tests/test_multihost.py (run under ``python -m k3_jax.launch``): before dying it waits until
the checkpoint of step ``$K3_DIE_AFTER_STEP - 1`` (or earlier, per ``--save-every``) is committed, so the kill
lands at a known point: after a committed checkpoint and after a step that the resumed run must repeat.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3_jax.cli import train  # noqa: E402
from k3_jax.training import metrics  # noqa: E402

DIE_STEP = int(os.environ["K3_DIE_AFTER_STEP"])
DIE_PROCESS = int(os.environ.get("K3_DIE_PROCESS", "1"))
CKPT_STEP = int(os.environ["K3_DIE_AFTER_CHECKPOINT"])
_log = metrics.MetricsLogger.log


def _log_then_die(self, step, row, kind="train"):
    _log(self, step, row, kind)
    import jax

    if kind == "train" and step == DIE_STEP and jax.process_index() == DIE_PROCESS:
        workdir = Path(sys.argv[sys.argv.index("--workdir") + 1])
        committed = workdir / "checkpoints" / str(CKPT_STEP) / "commit_success.txt"
        deadline = time.time() + 120
        while not committed.exists() and time.time() < deadline:
            time.sleep(0.05)
        print(f"process {DIE_PROCESS}: SIGKILL after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


metrics.MetricsLogger.log = _log_then_die

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
