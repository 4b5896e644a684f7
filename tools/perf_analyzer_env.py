"""Make the `perf-analyzer` wheel's binary runnable here, and print the command to run it.

    python tools/perf_analyzer_env.py [--cache-dir .cache/perf_analyzer] [--version 2.60.0]

The perf-analyzer wheel (2.58+) is tagged manylinux_2_38: its `perf_analyzer` binary needs
glibc >= 2.38 and libstdc++ with GLIBCXX_3.4.32. Debian 12 has glibc 2.36, so pip refuses the
wheel and the binary would not start. On such a machine this tool

1. installs the wheel into a private folder (`pip install --target`, forcing the 2.38 platform
   tag since pip refuses it for the venv),
2. downloads Debian trixie's `libc6`, `libstdc++6` and `libgcc-s1` with `apt-get download`,
   using its own sources list and package lists so the system's apt setup is left alone, and
   unpacks them with `dpkg -x` (nothing is installed system-wide),
3. writes an executable wrapper that starts the binary through trixie's dynamic loader with
   trixie's libraries first and the system's after them (for libssl, libcrypto and libz, which
   the binary also needs and Debian 12 has in compatible versions).

Where glibc is already >= 2.38 the wheel is installed into the running interpreter's environment
as usual and the wrapper just execs the real binary. Every step is skipped when its result is
already there, so running the tool again is cheap. The wrapper path is printed on the last line
of stdout. (This build of perf_analyzer has no `--help`; the check runs `--version`.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "perf_analyzer"
DEFAULT_VERSION = "2.60.0"
REQUIRED_GLIBC = (2, 38)
DEBIAN_SOURCE = "deb http://deb.debian.org/debian trixie main"
RUNTIME_DEBS = ("libc6", "libstdc++6", "libgcc-s1")
# machine → (Debian multiarch triplet, dynamic loader name, wheel platform tag)
ARCHES = {
    "x86_64": ("x86_64-linux-gnu", "ld-linux-x86-64.so.2", "manylinux_2_38_x86_64"),
    "aarch64": ("aarch64-linux-gnu", "ld-linux-aarch64.so.1", "manylinux_2_38_aarch64"),
}
APT_TIMEOUT_S = 600
PIP_TIMEOUT_S = 600


def _log(msg: str) -> None:
    print(f"[perf_analyzer_env] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], timeout_s: int, cwd: Path | None = None) -> None:
    _log("$ " + shlex.join(cmd))
    # Child output goes to stderr so that stdout carries only the wrapper path.
    subprocess.run(cmd, check=True, timeout=timeout_s, cwd=cwd, stdout=sys.stderr)


def glibc_version() -> tuple[int, int]:
    """This machine's glibc (major, minor); (0, 0) when not glibc."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""  # e.g. "glibc 2.36"
    except (ValueError, OSError):
        text = ""
    parts = text.split()[-1].split(".") if text else []
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def _installed_version(site_dir: Path) -> str | None:
    """Version of the perf-analyzer distribution installed in `site_dir`, if any."""
    for info in site_dir.glob("perf_analyzer-*.dist-info"):
        return info.name[len("perf_analyzer-"):-len(".dist-info")]
    return None


def _binary_in(site_dir: Path) -> Path:
    return site_dir / "perf_analyzer" / "bin" / "perf_analyzer"


def find_or_install_binary(cache_dir: Path, version: str, native: bool) -> Path:
    """Path of the real `perf_analyzer` binary of `version`, installing the wheel if needed.

    `native`: glibc is new enough for pip to install the wheel into this environment.
    """
    spec = importlib.util.find_spec("perf_analyzer")  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        site_dir = Path(next(iter(spec.submodule_search_locations))).parent
        if _installed_version(site_dir) == version and _binary_in(site_dir).is_file():
            return _binary_in(site_dir)
    if native:
        _run([sys.executable, "-m", "pip", "install", "--no-deps", f"perf-analyzer=={version}"], PIP_TIMEOUT_S)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("perf_analyzer")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("pip installed perf-analyzer but it cannot be found")
        return _binary_in(Path(next(iter(spec.submodule_search_locations))).parent)

    target = cache_dir / "wheel"
    if _installed_version(target) != version or not _binary_in(target).is_file():
        wheel_platform = ARCHES[platform.machine()][2]
        # pip only installs a wheel for a newer glibc when told the platform, and then only
        # into a --target folder: that is why the wheel does not go into the venv here.
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--upgrade",
              "--platform", wheel_platform, "--target", str(target), f"perf-analyzer=={version}"],
             PIP_TIMEOUT_S)
    binary = _binary_in(target)
    if not binary.is_file():
        raise RuntimeError(f"the perf-analyzer wheel has no binary at {binary}")
    binary.chmod(0o755)
    return binary


def fetch_runtime(cache_dir: Path) -> Path:
    """Unpacked trixie runtime libraries; returns their library folder (idempotent)."""
    triplet, loader, _ = ARCHES[platform.machine()]
    root = cache_dir / "trixie-root"
    lib_dir = root / "usr" / "lib" / triplet
    marker = root / ".complete"
    if marker.is_file() and (lib_dir / loader).exists():
        return lib_dir

    apt_dir = cache_dir / "apt"
    debs_dir = apt_dir / "debs"
    for sub in (apt_dir / "lists" / "partial", apt_dir / "cache" / "archives" / "partial", debs_dir):
        sub.mkdir(parents=True, exist_ok=True)
    sources = apt_dir / "sources.list"
    sources.write_text(DEBIAN_SOURCE + "\n")
    # Private lists, sources and cache: the system's apt state and sources stay untouched.
    # Sandbox user root: the private folders are not readable by the _apt user.
    apt_opts = ["-o", f"Dir::State::Lists={apt_dir / 'lists'}", "-o", f"Dir::Etc::SourceList={sources}",
                "-o", "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::Cache={apt_dir / 'cache'}",
                "-o", "APT::Sandbox::User=root"]
    _run(["apt-get", *apt_opts, "update"], APT_TIMEOUT_S)
    for old in debs_dir.glob("*.deb"):
        old.unlink()
    _run(["apt-get", *apt_opts, "download", *RUNTIME_DEBS], APT_TIMEOUT_S, cwd=debs_dir)
    debs = sorted(debs_dir.glob("*.deb"))
    if len(debs) != len(RUNTIME_DEBS):
        raise RuntimeError(f"expected {len(RUNTIME_DEBS)} .deb files in {debs_dir}, found {len(debs)}")
    root.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        _run(["dpkg", "-x", str(deb), str(root)], APT_TIMEOUT_S)
    if not (lib_dir / loader).exists():
        raise RuntimeError(f"{loader} missing from {lib_dir} after unpacking {[d.name for d in debs]}")
    marker.write_text("\n".join(d.name for d in debs) + "\n")
    return lib_dir


def wrapper_script(binary: Path, lib_dir: Path | None) -> str:
    """Shell wrapper text: exec the binary directly, or through `lib_dir`'s loader first."""
    if lib_dir is None:
        command = f'exec {shlex.quote(str(binary))} "$@"'
    else:
        triplet, loader, _ = ARCHES[platform.machine()]
        library_path = f"{lib_dir}:/lib/{triplet}:/usr/lib/{triplet}"
        command = (f"exec {shlex.quote(str(lib_dir / loader))} --library-path {shlex.quote(library_path)} "
                   f'{shlex.quote(str(binary))} "$@"')
    return f"#!/bin/sh\n# Written by tools/perf_analyzer_env.py: runs perf_analyzer on this machine.\n{command}\n"


def write_wrapper(path: Path, text: str) -> None:
    """Write `text` as an executable file, atomically and only when it changed."""
    if path.is_file() and path.read_text() == text and os.access(path, os.X_OK):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
        tmp.write(text)
    os.chmod(tmp.name, 0o755)
    os.replace(tmp.name, path)


def check(wrapper: Path) -> str:
    """Run `wrapper --version`; returns its output or raises with what went wrong."""
    proc = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=60, check=False)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or "Perf Analyzer" not in output:
        raise RuntimeError(f"{wrapper} --version failed (rc={proc.returncode}): {output[-2000:]}")
    return output


def ensure(cache_dir: Path = DEFAULT_CACHE_DIR, version: str = DEFAULT_VERSION) -> Path:
    """Everything above; returns the wrapper's path (`cache_dir/perf_analyzer`)."""
    if platform.system() != "Linux" or platform.machine() not in ARCHES:
        raise RuntimeError(f"unsupported platform {platform.system()} {platform.machine()}")
    native = glibc_version() >= REQUIRED_GLIBC
    binary = find_or_install_binary(cache_dir, version, native)
    lib_dir = None if native else fetch_runtime(cache_dir)
    wrapper = cache_dir / "perf_analyzer"
    write_wrapper(wrapper, wrapper_script(binary, lib_dir))
    _log(check(wrapper).splitlines()[0])
    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--version", default=DEFAULT_VERSION, help="perf-analyzer wheel version")
    args = parser.parse_args(argv)
    try:
        wrapper = ensure(args.cache_dir.resolve(), args.version)
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        _log(f"error: {exc}")
        return 1
    print(wrapper)
    return 0


if __name__ == "__main__":
    sys.exit(main())
