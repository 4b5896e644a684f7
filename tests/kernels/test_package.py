"""The package's import contract: usable names, and no triton needed until a kernel is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import inflight.kernels as kernels

WITHOUT_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # as if triton were not installed
    import inflight.engine.llm_engine, inflight.kernels as kernels, inflight.kernels.reference
    assert not kernels.triton_available()
    try:
        kernels.rms_norm
    except ImportError as exc:
        assert "triton" in str(exc), exc
    else:
        raise AssertionError("using a kernel without triton must raise ImportError")
    print("ok")
""")


def test_engine_and_package_import_without_triton():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_exports_resolve_lazily():
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), name
