"""The documentation runs: every ```python block of README.md and docs/*.md is executed, and the README's
relative links point at files of the repository.

Each block runs on its own (`exec` in a fresh namespace, no preamble: blocks import what they use), on CPU
with tiny shapes, in this process so that torch and fastckpt are imported once. A block that raises fails
its own test, named by file and block number (README.md#3: the third python block), with its first line
number and the traceback. A block that needs an optional package which is not installed (the GPU image may
lack transformers or DeepSpeed) or a newer torch skips with the reason instead.
"""

from __future__ import annotations

import pathlib
import re
import traceback
import warnings

import pytest
import torch

from tests.helpers import num_threads

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
OPTIONAL_PACKAGES = {"transformers", "peft", "accelerate", "deepspeed", "trl", "datasets", "tokenizers", "bitsandbytes"}


def python_blocks(path: pathlib.Path) -> list[tuple[int, int, str]]:
    """(block number from 1, line of its first code line, code) of every ```python block in `path`."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1).strip() == "python":
            line = text.count("\n", 0, match.start(2)) + 1
            blocks.append((len(blocks) + 1, line, match.group(2)))
    return blocks


BLOCKS = [
    pytest.param(path, number, line, code, id=f"{path.relative_to(ROOT)}#{number}")
    for path in DOCS
    for number, line, code in python_blocks(path)
]


def needs_newer_torch(code: str) -> str | None:
    """Why this torch cannot run `code`, or None: codecs under torch's SAC and fastckpt.compile need torch 2.14."""
    from fastckpt import compiled, hybrid

    if "hybrid.selective(" in code and not hybrid._sac_honours_hooks():
        return f"hybrid.selective with a codec needs torch >= 2.14 (this is {torch.__version__})"
    if "fastckpt.compile(" in code and not compiled.IN_GRAPH_STORAGE:
        return f"fastckpt.compile needs torch >= {compiled.TORCH_NEEDED} (this is {torch.__version__})"
    return None


@pytest.fixture
def isolated():
    """Each block starts from the same seed and leaves no global state behind (DeepSpeed settings, a process
    group, compiled graphs, torch's thread count)."""
    torch.manual_seed(0)
    with num_threads():
        yield
    torch.compiler.reset()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    import sys

    deepspeed_integration = sys.modules.get("fastckpt.integrations.deepspeed")
    if deepspeed_integration is not None:
        deepspeed_integration.reset(configuration=True)


def test_every_doc_has_python_blocks_found():
    assert len(BLOCKS) >= 10, [p.id for p in BLOCKS]
    assert any(p.id.startswith("README.md#") for p in BLOCKS)


@pytest.mark.parametrize("path, number, line, code", BLOCKS)
def test_python_block_runs(path, number, line, code, isolated, capsys):
    reason = needs_newer_torch(code)
    if reason:
        pytest.skip(reason)
    where = f"{path.relative_to(ROOT)} python block {number} (line {line})"
    compiled = compile(code, f"<{where}>", "exec")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation notes of the packages used are not the docs' errors
            exec(compiled, {"__name__": f"doc_block_{number}"})
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] in OPTIONAL_PACKAGES:
            pytest.skip(f"{where} needs {error.name}, which is not installed")
        pytest.fail(f"{where} raised:\n{traceback.format_exc()}", pytrace=False)
    except Exception:
        pytest.fail(f"{where} raised:\n{traceback.format_exc()}", pytrace=False)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(path):
    targets = [t for t in LINK.findall(path.read_text()) if "://" not in t]
    missing = [t for t in targets if not (path.parent / t).resolve().exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_is_a_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    quickstart = python_blocks(ROOT / "README.md")[0][2]
    assert len(quickstart.splitlines()) <= 15, "the README's quickstart should stay within 15 lines"
