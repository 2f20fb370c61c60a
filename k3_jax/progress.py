"""Progress of long jobs (conversion, export, verify, training, long prefills): one mechanism for all of them.

``Progress(job, total, unit=...)`` shows

* a tqdm bar (done / total, rate, ETA, extra fields) when its stream is a terminal;
* otherwise plain lines, at most one every ``interval_s`` seconds plus one at the end, of the form::

      convert: pct=41.7 done=5.86GB total=14.05GB rate=0.32GB/s eta=26s tensors=63/152 layer=4

  i.e. ``JOB: key=value ...`` with no spaces inside a value, so :func:`parse_line` (or a ``grep``) reads a log
  file back. Byte amounts are printed with SI units (``GB``, ``MB`` below 0.1 GB), other units as plain
  numbers (``done=120 total=1000 rate=3.51step/s``); ``rate`` is over the time since the previous line (a slow
  first step, e.g. a compile, drops out), ``eta`` is in seconds at that rate (``eta=?`` while none is known);
  the final line has ``elapsed=`` and the whole job's rate instead;
* nothing when :func:`set_quiet` was called (the CLIs' ``--quiet``).

The line interval defaults to 10 s and is read from ``K3_PROGRESS_INTERVAL_S`` (``0``: a line per update,
what tests use). Lines go to the stream (stderr by default) or to a ``write`` callable (e.g. a logger's
``info``), which also forces line mode.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

_QUIET = False
DEFAULT_INTERVAL_S = 10.0
LONG_PREFILL_TOKENS = 2048  # prompts at least this long get prefill progress lines in the serving log


def set_quiet(quiet: bool = True) -> None:
    """Silence every later :class:`Progress` of this process (bars and lines)."""
    global _QUIET
    _QUIET = bool(quiet)


def is_quiet() -> bool:
    return _QUIET


def _interval_from_env() -> float:
    raw = os.environ.get("K3_PROGRESS_INTERVAL_S")
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ValueError(f"K3_PROGRESS_INTERVAL_S must be a number of seconds, got {raw!r}") from None


def _fmt_amount(x: float, unit: str) -> str:
    if unit == "B":
        return f"{x / 1e9:.2f}GB" if x >= 1e8 or x == 0 else f"{x / 1e6:.2f}MB"
    return f"{x:g}" if float(x).is_integer() else f"{x:.4g}"


def _fmt_rate(rate: float | None, unit: str) -> str:
    if rate is None:
        return "?"
    if unit == "B":
        return f"{rate / 1e9:.3g}GB/s" if rate >= 1e8 else f"{rate / 1e6:.3g}MB/s"
    return f"{rate:.3g}{unit}/s"


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        v = f"{v:.4g}"
    return str(v).replace(" ", "_")


class Progress:
    """Progress of one job over ``total`` units (bytes: ``unit="B"``; steps, tokens, shards ...).

    ``update(n, **fields)`` adds ``n`` done units and sets extra fields shown after the numbers (``tensors``,
    ``layer``, ``loss`` ...; values without spaces, floats shortened to 4 significant digits). ``initial``
    counts units already done before this run (a resumed training run): they count towards ``pct`` but not
    towards the rate. Use as a context manager or call :meth:`close` (which prints the final line).
    """

    def __init__(self, job: str, total: float | None, *, unit: str = "it", initial: float = 0,
                 stream: TextIO | None = None, write: Callable[[str], Any] | None = None,
                 interval_s: float | None = None, mode: str = "auto"):
        if mode not in ("auto", "bar", "lines", "off"):
            raise ValueError(f"Progress mode must be auto, bar, lines or off, got {mode!r}")
        self.job, self.total, self.unit = job, total, unit
        self.n = self._n0 = initial
        self.fields: dict[str, Any] = {}
        self._stream = stream if stream is not None else sys.stderr
        self._write = write
        self.interval_s = _interval_from_env() if interval_s is None else interval_s
        self._t0 = self._last = time.monotonic()
        self._mark = (self._t0, self.n)  # (time, done) at the previous line: the rate's window
        self._bar = None
        self._closed = False
        if _QUIET or mode == "off":
            self.mode = "off"
        elif write is not None or mode == "lines":
            self.mode = "lines"
        elif mode == "bar" or _isatty(self._stream):
            self.mode = "bar"
            self._bar = self._make_bar()
        else:
            self.mode = "lines"

    def _make_bar(self):
        from tqdm import tqdm

        scale = self.unit == "B"
        return tqdm(total=self.total, initial=self.n, desc=self.job, unit=self.unit, unit_scale=scale,
                    unit_divisor=1000, file=self._stream, dynamic_ncols=True, mininterval=0.5)

    # ------------------------------------------------------------------ updates
    def update(self, n: float = 1, wait: Any = None, **fields: Any) -> None:
        """Add ``n`` done units. ``wait``: an array (anything with ``block_until_ready``) the work of this update
        produced; it is waited for only when a line is due, so the reported rate is the device's, not the
        dispatcher's."""
        self.n += n
        self.fields.update(fields)
        if self.mode == "bar":
            self._bar.update(n)
            if fields:
                self._bar.set_postfix_str(self._fields_str(), refresh=False)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last >= self.interval_s:
                if wait is not None and hasattr(wait, "block_until_ready"):
                    wait.block_until_ready()
                self._emit(self.line())
                self._last = time.monotonic()
                self._mark = (self._last, self.n)

    def set(self, n: float | None = None, **fields: Any) -> None:
        """Set the done count to ``n`` (e.g. the step a trainer reached) and/or the fields."""
        if n is not None:
            self.update(n - self.n, **fields)
        else:
            self.update(0, **fields)

    def write(self, text: str) -> None:
        """Print a message without breaking the bar (``tqdm.write``), or as a plain line."""
        if self.mode == "off":
            return
        if self.mode == "bar":
            self._bar.write(text, file=self._stream)
        else:
            self._emit(text)

    def close(self) -> None:
        """Finish: the bar closes, line mode prints a final line (with the total time)."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "bar":
            self._bar.close()
        elif self.mode == "lines":
            self._mark = (self._t0, self._n0)  # the final line reports the whole run's rate
            self._emit(self.line(final=True))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ lines
    def rate(self) -> float | None:
        """Units per second since the previous line (so a slow first step, e.g. a compile, stops counting once
        it is a line behind), or since the start for the first line and the final one."""
        now = time.monotonic()
        t, n = self._mark
        if now - t <= 0 or self.n - n <= 0:
            t, n = self._t0, self._n0
        done, dt = self.n - n, now - t
        return done / dt if dt > 0 and done > 0 else None

    def line(self, final: bool = False) -> str:
        """The plain progress line (see the module docstring) for the current state."""
        parts = []
        if self.total:
            parts.append(f"pct={100.0 * self.n / self.total:.1f}")
        parts.append(f"done={_fmt_amount(self.n, self.unit)}")
        if self.total is not None:
            parts.append(f"total={_fmt_amount(self.total, self.unit)}")
        rate = self.rate()
        parts.append(f"rate={_fmt_rate(rate, self.unit)}")
        if final:
            parts.append(f"elapsed={time.monotonic() - self._t0:.1f}s")
        elif self.total is not None:
            eta = (self.total - self.n) / rate if rate else None
            parts.append(f"eta={'?' if eta is None else f'{max(eta, 0.0):.0f}s'}")
        if self.fields:
            parts.append(self._fields_str())
        return f"{self.job}: " + " ".join(parts)

    def _fields_str(self) -> str:
        return " ".join(f"{k}={_fmt_value(v)}" for k, v in self.fields.items())

    def _emit(self, text: str) -> None:
        if self._write is not None:
            self._write(text)
        else:
            print(text, file=self._stream, flush=True)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def parse_line(line: str) -> tuple[str, dict[str, str]]:
    """``"JOB: k=v k=v"`` -> ``(JOB, {k: v})`` (inverse of :meth:`Progress.line`); raises ValueError otherwise."""
    job, sep, rest = line.partition(": ")
    if not sep or not job or " " in job:
        raise ValueError(f"not a progress line: {line!r}")
    fields = {}
    for tok in rest.split():
        k, eq, v = tok.partition("=")
        if not eq or not k:
            raise ValueError(f"not a progress line (token {tok!r}): {line!r}")
        fields[k] = v
    return job, fields



def prefill_progress(prompt_tokens: int, request_id: str) -> Progress | None:
    """Progress lines (``prefill: … request=ID``) on the ``k3_jax.serving`` logger for a prompt of at least
    :data:`LONG_PREFILL_TOKENS` tokens; ``None`` for shorter prompts (nothing to report)."""
    if prompt_tokens < LONG_PREFILL_TOKENS:
        return None
    prog = Progress("prefill", prompt_tokens, unit="tok", write=logging.getLogger("k3_jax.serving").info,
                    mode="off" if _QUIET else "lines")
    prog.fields["request"] = request_id
    return prog
