"""python/README.md's examples run as written (on cuda where there is a GPU, else on
host) and train: ten printed losses, the last below the first. The first (a ResidualStack)
and the GPT example (sg.LanguageModel) also stand in the repository's README. Runs under
pytest or as `python3 readme_test.py [README.md]`."""

import contextlib
import io
import os
import re
import sys
from pathlib import Path


def readme_path():
    candidates = [os.environ.get("STEPGRAPH_README", ""), "python/README.md",
                  Path(__file__).resolve().parent / "README.md",
                  Path(__file__).resolve().parents[2] / "python" / "README.md"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError(f"python/README.md not found (looked at {candidates}); set STEPGRAPH_README")


def example_code(path):
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert blocks, f"{path} has no python code block"
    return blocks[0]


def gpt_example_code(path):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S) if "sg.LanguageModel(" in b]
    assert len(blocks) == 1, f"{path} should hold one python block with the GPT (sg.LanguageModel) example"
    return blocks[0]


def run_and_expect_training(code):
    assert 10 <= len(code.strip().splitlines()) <= 20, "the example is meant to stay about 15 lines"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "python/README.md", "exec"), {"__name__": "readme_example"})
    text = out.getvalue()
    sys.stdout.write(text)
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", text)]
    assert len(losses) == 10, text
    assert losses[-1] < losses[0], f"the example did not train: {losses}"
    assert "0 tensor(s) in the pool report" in text, text


def test_readme_example_runs_and_trains():
    run_and_expect_training(example_code(readme_path()))


def test_readme_gpt_example_runs_and_trains():
    run_and_expect_training(gpt_example_code(readme_path()))


def top_readme_path():
    candidates = [os.environ.get("STEPGRAPH_TOP_README", ""), "README.md",
                  Path(__file__).resolve().parent / "top_README.md",
                  Path(__file__).resolve().parents[2] / "README.md"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and Path(candidate).read_text().startswith("# StepGraph\n"):
            return Path(candidate)
    raise FileNotFoundError(f"the repository's README.md not found (looked at {candidates})")


def test_top_readme_shows_the_tested_example():
    """The repository README shows the very example the test above runs."""
    assert example_code(top_readme_path()) == example_code(readme_path())
    assert gpt_example_code(top_readme_path()) == gpt_example_code(readme_path())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ["STEPGRAPH_README"] = sys.argv[1]
    test_readme_example_runs_and_trains()
    test_readme_gpt_example_runs_and_trains()
    test_top_readme_shows_the_tested_example()
    print("readme_test: 3 passed")
