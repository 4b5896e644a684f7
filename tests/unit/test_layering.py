"""The control plane and the wire contract stay free of torch and of model libraries.

The guide's layering rule (scheduler, block manager, detokenizer hold no CUDA) is what lets this
tier run on a bare Python with numpy; a fresh interpreter imports each module and reports what
came with it, so an import that drags torch in fails here, not on a newcomer's machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

TORCH_FREE = [
    "inflight.core.block_manager", "inflight.core.scheduler", "inflight.core.sequence",
    "inflight.core.outputs", "inflight.core.beam_search", "inflight.executor.types", "inflight.executor.config",
    "inflight.executor.stats", "inflight.executor.features", "inflight.serving.convert",
    "inflight.serving.inputs", "inflight.serving.params", "bls.pipeline", "bls.stop_strings",
    "inflight.serving.backend", "inflight.serving.wire", "inflight.serving.request_table", "inflight.serving.poll_turns",
    "inflight.serving.delivery", "inflight.serving.engine_client", "inflight.serving.metrics",
    "inflight.supervisor", "openai_frontend.workers", "postprocessing.acks", "ensemble.io_contract", "ensemble.params", "ensemble.word_list",
    "ensemble.errors", "preprocessing", "preprocessing.step_outputs", "postprocessing",
]
HEAVY = ["torch", "transformers", "tokenizers", "safetensors", "tritonclient"]


def test_control_plane_modules_import_without_torch():
    script = (
        "import importlib, json, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
