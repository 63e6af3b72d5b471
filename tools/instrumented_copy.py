"""What the trace tools (fwd_cta_trace.py, fwd_turn_trace.py, decode_cta_trace.py) share: a
scratch copy of cpp/ and of a standalone driver, edited by exact text replacements.

Each replacement must find its text exactly once, so a trace tool stops with the text it could
not find when the kernel it instruments changes, instead of instrumenting the wrong place.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Top-level folders of the tree that a scratch copy must not be or lie in.
PROTECTED = {".git", ".ci", "benchmarks", "cpp", "docs", "jax_flash", "tests", "tools"}

Patches = list[tuple[str, str]]


def patch(path: pathlib.Path, patches: Patches) -> None:
    """Replaces each (old, new) in the file at `path`; old must occur exactly once."""
    text = path.read_text()
    for old, new in patches:
        if text.count(old) != 1:
            raise SystemExit(f"{path}: expected the text once, found {text.count(old)}:\n{old}")
        text = text.replace(old, new)
    path.write_text(text)


def append(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text().rstrip() + "\n" + text)


def scratch_copy(description: str, tool_files: tuple[str, ...]) -> pathlib.Path:
    """Parses the command line (one argument: the scratch directory), replaces that directory by
    a copy of cpp/ and of `tool_files` from tools/, and returns it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("dest", type=pathlib.Path, help="scratch directory (replaced)")
    dest = parser.parse_args().dest.resolve()
    top = dest.relative_to(ROOT).parts[:1] if dest.is_relative_to(ROOT) else ()
    if dest == ROOT or dest in ROOT.parents or set(top) & PROTECTED:
        raise SystemExit(f"{dest}: not a scratch directory (it would replace part of the tree)")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "cpp", dest / "cpp")
    (dest / "tools").mkdir()
    for name in tool_files:
        shutil.copy(ROOT / "tools" / name, dest / "tools" / name)
    return dest


def instrument_forward(
    description: str, marks: str, kernel_patches: Patches, dump: str, dump_fn: str
) -> None:
    """The forward trace tools' copy: cpp/ and tools/wgmma_check.cu in the scratch directory named
    on the command line, `marks` (the trace's buffer and macros) opening the kernel namespace of
    cpp/cuda/fwd_wgmma.cuh and `kernel_patches` applied there, `dump` (which defines
    `void dump_fn(const char* label)`) appended to cpp/cuda/fwd_wgmma.cu, and the driver calling
    it after every timed cell."""
    dest = scratch_copy(description, ("wgmma_check.cu", "cuda_check.h"))
    namespace = "namespace jax_flash::cuda::sm90 {\n"
    patch(dest / "cpp/cuda/fwd_wgmma.cuh", [(namespace, namespace + marks), *kernel_patches])
    append(dest / "cpp/cuda/fwd_wgmma.cu", dump)
    patch(
        dest / "tools/wgmma_check.cu",
        [
            ("namespace {", f"void {dump_fn}(const char* label);\nnamespace {{"),
            (
                '  std::printf("\\n");\n  return tflops;',
                f'  std::printf("\\n");\n  {dump_fn}(label);\n  return tflops;',
            ),
        ],
    )
    print(f"instrumented copy in {dest}")
