"""README.md is the front door: short, dated runs elsewhere (benchmarks/RESULTS.md), a link to docs/index.md, and
every code block runs as written: the Python blocks are executed (on SmolLM2-135M, so integration tier), the
shell blocks' scripts exist and parse (``bash -n``) and their ``tl-steering`` command lines parse with the CLI's
own parser (running them is the job of scripts/main_job.sh and CI; the pip lines install from placeholders)."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", README, re.M | re.S)


def test_readme_is_short_links_the_docs_and_holds_no_dated_run():
    assert len(README.splitlines()) <= 160
    assert "(docs/index.md)" in README and "(benchmarks/RESULTS.md)" in README
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", README) == []  # dated runs live in benchmarks/RESULTS.md
    assert {lang for lang, _ in BLOCKS} == {"bash", "python"} and len(BLOCKS) >= 5


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HISTORY = re.compile(r"(\bsince|\bbefore|\buntil|arXiv:\S+)[^.;]{0,20}$")  # a default's or format's history, the paper


def dated_runs(text: str) -> list[str]:
    """Lines that date a run: a date not introduced as history ("since", "before", "until") or as the paper's."""
    return [line for line in text.splitlines() for m in DATE.finditer(line) if not HISTORY.search(line[: m.start()])]


def test_docs_pages_hold_no_dated_run():
    """Dated benchmark runs live in benchmarks/RESULTS.md (date, commit, machine, command); a docs page keeps the
    method and points there."""
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "CONTRIBUTING.md"]
    assert len(pages) >= 10
    assert {str(p.relative_to(ROOT)): dated_runs(p.read_text(encoding="utf-8")) for p in pages
            if dated_runs(p.read_text(encoding="utf-8"))} == {}
    # the check sees a run in both styles (a benchmarks/RESULTS.md row, a dated sentence) and lets history pass
    assert dated_runs("| 2026-12-05 | 3dc7e3d | 2 idle CPU cores | `benchmarks/x.py` | 1.19x |")
    assert dated_runs("Measured (2026-12-04, `benchmarks/x.py`, 2 cores): 1.1x") and dated_runs("### Idle (2026-12-03)")
    assert not dated_runs("the default since 2026-12-04; 0, k/3 before 2026-12-04; arXiv:2608.02071v1 (2026-08-03)")
    assert dated_runs((ROOT / "benchmarks/RESULTS.md").read_text(encoding="utf-8"))

def test_shell_blocks_name_scripts_that_exist_and_command_lines_that_parse():
    from tl_steering.cli import build_parser

    checked = 0
    for lang, code in BLOCKS:
        if lang != "bash":
            continue
        for line in code.splitlines():
            words = shlex.split(line.split("  #", 1)[0])
            if words[:1] == ["bash"]:
                script = ROOT / words[1]
                assert script.is_file(), line
                assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, line
                checked += 1
            elif words and words[0].endswith("tl-steering"):
                build_parser().parse_args(words[1:])  # exits (SystemExit) on a bad argument
                checked += 1
    assert checked >= 5


@pytest.mark.integration
@pytest.mark.one_line("tl4")  # the README's own line (scripts/main_job.sh sets up .venv-tl4)
def test_python_blocks_run_as_written(capsys):
    import warnings

    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lang, code in BLOCKS:
            if lang == "python":
                exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    # the README's own path emits no warning a user cannot act on: none from tl_steering (its probe pattern with
    # the package's hook factories, its plan, its parallel copy), none of transformers' past_key_values notice
    ours = [f"{w.category.__name__}: {w.message}" for w in caught
            if "tl_steering" in str(w.filename) or str(w.filename) == "README.md"
            or "past_key_values" in str(w.message)
            or w.category.__module__.startswith("tl_steering")]
    assert ours == []
    out = capsys.readouterr().out
    assert "deficit" in out or "mean" in out  # the summary was printed
    assert namespace["trace"].result().get("tangent_alignment").shape == (namespace["model"].cfg.n_layers,)
    # the executor example: the parallelized plan generates its hook surrogate's greedy continuation (one full
    # forward per token, no cache; up to the end-of-sequence token, where generate stops by default)
    import torch

    model, plan = namespace["model"], namespace["plan"]
    assert plan.k == 4 and namespace["par"]._tl_steering_parallel["layers"] == plan.layers
    seq = model.to_tokens("The capital of France is")
    with torch.no_grad():
        for _ in range(12):
            logits = model.run_with_hooks(seq, fwd_hooks=plan.hooks(model))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if int(seq[0, -1]) == model.tokenizer.eos_token_id:
                break
    assert namespace["text"] == model.tokenizer.decode(seq[0], skip_special_tokens=True)
