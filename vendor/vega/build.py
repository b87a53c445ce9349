"""Writes dvc-plots.html: the page template `dvc plots show` fills (.dvc/config: plots.html_template), with Vega,
Vega-Lite and vega-embed inlined. DVC's own page loads them from a CDN and renders blank on a machine without a
network (most training clusters); this one needs nothing from outside.

    cd vendor/vega && npm pack vega@5.33.1 vega-lite@5.23.0 vega-embed@6.29.0 && python build.py *.tgz

The three packages are BSD-3-Clause (the Vega project; their notices are kept at the top of each minified file).
"""

from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

FILES = {"vega": "package/build/vega.min.js", "vega-lite": "package/build/vega-lite.min.js",
         "vega-embed": "package/build/vega-embed.min.js"}
PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>DVC plots</title>
<!-- {versions}: inlined by vendor/vega/build.py, so the page renders offline -->
{scripts_inline}
<style>body {{ font-family: system-ui, sans-serif; }} table {{ border-spacing: 15px; }}</style>
</head>
<body>
{{plot_divs}}
</body>
</html>
"""


def main(tarballs: list[str]) -> None:
    scripts, versions = [], []
    for name, member in FILES.items():
        tgz = next(t for t in tarballs if re.fullmatch(rf"{name}-[\d.]+\.tgz", Path(t).name))
        versions.append(Path(tgz).name[: -len(".tgz")])
        js = tarfile.open(tgz).extractfile(member).read().decode()
        # dvc_render fills {plot_divs}, {scripts} and {refresh_tag}; inlined code must not hold them or end the tag
        assert "</script" not in js and not re.search(r"\{(plot_divs|scripts|refresh_tag)\}", js), name
        scripts.append(f"<script>{js}</script>")
    page = PAGE.format(versions=", ".join(versions), scripts_inline="\n".join(scripts))
    (Path(__file__).parent / "dvc-plots.html").write_text(page)


if __name__ == "__main__":
    main(sys.argv[1:])
