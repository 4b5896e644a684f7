"""The product's layering, as tests.

1. The control plane and the wire contract stay free of torch and of model libraries. The
   guide's layering rule (scheduler, block manager, detokenizer hold no CUDA) is what lets this
   tier run on a bare Python with numpy; a fresh interpreter imports each module and reports
   what came with it, so an import that drags torch in fails here, not on a newcomer's machine.
2. Each folder imports only the folders below it (`ALLOWED`), read from every import statement
   of the product, lazy ones inside functions included; and no module imports itself back
   through others (no cycle), so the layers cannot knot again.
3. The product never imports its command lines (`tools/`), the scripts (`bench/`, `checks/`)
   and the tests never import each other, and nothing edits `sys.path`.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

TORCH_FREE = [
    "inflight.intmath", "inflight.core.block_manager", "inflight.core.scheduler", "inflight.core.sequence",
    "inflight.core.outputs", "inflight.core.beam_search", "inflight.core.ngram", "inflight.api.types",
    "inflight.api.config", "ensemble.sampling_distribution", "bls.speculative",
    "inflight.api.stats", "inflight.api.features", "inflight.serving.convert",
    "inflight.serving.inputs", "inflight.serving.params", "bls.pipeline", "bls.stop_strings",
    "inflight.hosts.backend", "inflight.serving.wire", "inflight.serving.request_table", "inflight.serving.poll_turns",
    "inflight.serving.delivery", "inflight.serving.engine_client", "inflight.serving.metrics",
    "ensemble.supervisor", "openai_frontend.workers", "postprocessing.acks", "ensemble.io_contract", "ensemble.wiring", "ensemble.params",
    "ensemble.word_list",
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


# ----- the folders' order ----------------------------------------------------------------------

# Each unit (a top-level package, or a folder or ground file of `inflight/`) and the units it may
# import. Ground first; each wing only downwards: the device side (`runner`) below the request
# side (`engine`), both below what drives an engine (`hosts`); `serving`, the Triton stub's
# side, never imports the engine (the engine process in `hosts` imports it).
_INFLIGHT_GROUND = {"inflight.api", "inflight.platform", "inflight.fatal_errors", "inflight.intmath"}
ALLOWED = {
    "ensemble": set(),
    "preprocessing": {"ensemble"},
    "postprocessing": {"ensemble", "preprocessing"},
    "bls": {"ensemble"},
    "openai_frontend": {"ensemble", "preprocessing"},
    "inflight.api": {"ensemble"},
    "inflight.intmath": set(),
    "inflight.platform": {"inflight.intmath"},
    "inflight.fatal_errors": set(),
    "inflight.core": {"inflight.api", "inflight.intmath"},
    "inflight.kernels": {"inflight.platform", "inflight.intmath"},
    "inflight.distributed": {"ensemble", "inflight.core", *_INFLIGHT_GROUND},
    "inflight.model": {"ensemble", "inflight.kernels", "inflight.distributed", *_INFLIGHT_GROUND},
    # kernels: greedy sampling's argmax on CUDA (inflight/kernels/greedy.py)
    "inflight.sampling": {"ensemble", "inflight.core", "inflight.kernels", *_INFLIGHT_GROUND},
    "inflight.lora": {"ensemble", "inflight.model", "inflight.kernels", *_INFLIGHT_GROUND},
    "inflight.runner": {"ensemble", "inflight.core", "inflight.model", "inflight.kernels", "inflight.sampling",
                        "inflight.distributed", "inflight.lora", *_INFLIGHT_GROUND},
    "inflight.engine": {"ensemble", "inflight.core", "inflight.sampling", "inflight.runner", "inflight.lora",
                        *_INFLIGHT_GROUND},
    "inflight.serving": {"ensemble", "inflight.core", "inflight.sampling", *_INFLIGHT_GROUND},
    "inflight.hosts": {"ensemble", "inflight.core", "inflight.sampling", "inflight.engine", "inflight.serving",
                       *_INFLIGHT_GROUND},
}
PRODUCT = ["ensemble", "preprocessing", "postprocessing", "bls", "openai_frontend", "inflight"]


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "inflight" and len(parts) > 1 else parts[0]


def _imports(path, modules) -> set[str]:
    """The product modules (of `modules`) that `path` imports, at any depth of its code:
    `from package import submodule` names the submodule, `from module import name` the module."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found.update(submodules or {node.module})
    return {name for name in found if name in modules and name != "inflight"}


def _product_modules() -> dict[str, set[str]]:
    """Module name -> the product modules it imports."""
    paths = {".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for root in PRODUCT for p in (REPO_ROOT / root).rglob("*.py")}
    return {module: _imports(path, set(paths)) for module, path in paths.items()}


def test_each_folder_imports_only_the_folders_below_it():
    wrong = sorted({(module, name) for module, names in _product_modules().items() for name in names
                    if _unit(name) != _unit(module) and _unit(name) not in ALLOWED[_unit(module)]})
    assert not wrong, "imports against the layering (module -> what it imports): " + ", ".join(
        f"{module} -> {name}" for module, name in wrong)


def test_no_product_module_imports_itself_back():
    graph = _product_modules()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for name in sorted(graph.get(module, ())):
            if state.get(name) == 1:
                cycles.append(path[path.index(name):] + [name] if name in path else [module, name])
            elif name not in state:
                visit(name, path + [name])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# ----- the product, its command lines, the scripts and the tests ------------------------------

# Who may import whom among the top-level folders: the product never reaches up to its command
# lines (`tools`), and neither the scripts (`bench`, `checks`) nor the tests import each other;
# what both need lives in `tools` or the product.
FOLDER_RULES = {
    "product": {"tools", "bench", "checks", "tests"},  # what each may NOT import
    "model_repository": {"tools", "bench", "checks", "tests"},
    "tools": {"bench", "checks", "tests"},
    "bench": {"checks", "tests"},
    "checks": {"tests"},
    "tests": {"bench", "checks"},
}


def _top_level_imports(path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_product_tools_scripts_and_tests_import_only_downwards():
    wrong = []
    for folder, forbidden in FOLDER_RULES.items():
        roots = PRODUCT if folder == "product" else [folder]
        for root in roots:
            for path in (REPO_ROOT / root).rglob("*.py"):
                bad = _top_level_imports(path) & forbidden
                wrong += [f"{path.relative_to(REPO_ROOT)} imports {name}" for name in sorted(bad)]
    assert not wrong, "; ".join(wrong)


def test_nothing_edits_sys_path():
    """Command lines, scripts and tests import the product as installed (`make setup`'s
    editable install), never by editing `sys.path`."""
    import re

    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=")
    found = [str(path.relative_to(REPO_ROOT)) for root in ("tools", "bench", "checks", "tests", *PRODUCT)
             for path in (REPO_ROOT / root).rglob("*.py") if edits.search(path.read_text())]
    assert not found, f"sys.path edited in: {found}"
