"""Every citation of docs/design.md in the code names a section that exists there: the formulas the
code implements are restated in the repository, and a reader can open them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_design_citation_names_a_section_of_docs_design_md():
    headings = [line.lstrip("#").strip() for line in (ROOT / "docs" / "design.md").read_text().splitlines()
                if line.startswith("#")]
    cited = []
    for path in sorted((ROOT / "cospec").rglob("*.py")):
        text = " ".join(path.read_text().split())  # a citation may wrap over lines
        for match in re.finditer(r'docs/design\.md, ((?:"[^"]+"(?: and )?)+)', text):
            cited += [(path.name, name) for name in re.findall(r'"([^"]+)"', match.group(1))]
    assert cited, "the code cites docs/design.md by section"
    missing = [(f, name) for f, name in cited if not any(h.startswith(name) for h in headings)]
    assert not missing, f"cited sections not in docs/design.md: {missing}"
