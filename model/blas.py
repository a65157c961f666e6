"""Pin OpenBLAS's kernel family before numpy loads it, so the batch-invariant tiles hold.

``model.llama.matmul`` relies on OpenBLAS's SkylakeX small-matrix kernel and its size rule. A
``DYNAMIC_ARCH`` OpenBLAS (numpy's wheels) picks its kernels from the CPU it finds, and on some
AVX-512 CPUs (an AMD EPYC vCPU with AVX512-BF16, seen in CI) it picks a family whose small products
round differently with the number of rows: a sequence's bits then depended on its batch
(tests/test_batch_invariance.py failed). So do families chosen by hand: this machine image sets
``OPENBLAS_CORETYPE=Haswell``, whose kernels have no small-matrix path. While batch invariance is
promised (``BATCH_INVARIANT`` not ``0``, the default) and the CPU has AVX-512F, the SkylakeX family
is asked for whatever ``OPENBLAS_CORETYPE`` says (it runs on any AVX-512F CPU); with
``BATCH_INVARIANT=0`` the variable is left as the operator set it.

Source: OpenBLAS ``driver/others/dynamic.c`` (``OPENBLAS_CORETYPE`` overrides the CPU detection).
"""

from __future__ import annotations

import os
import sys


def pin_coretype(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """Set ``OPENBLAS_CORETYPE=SkylakeX`` on an AVX-512F CPU while ``BATCH_INVARIANT`` is not ``0``
    and numpy is not loaded yet (it reads the variable once, when it loads OpenBLAS); return the
    value in effect."""
    if os.environ.get("BATCH_INVARIANT", "1").strip() == "0" or "numpy" in sys.modules:
        return os.environ.get("OPENBLAS_CORETYPE")
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return os.environ.get("OPENBLAS_CORETYPE")
    if " avx512f" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    return os.environ.get("OPENBLAS_CORETYPE")
