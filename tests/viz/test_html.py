"""The HTML page without a browser: self-contained, and the data it carries is the report's, byte for byte."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from hyperdryrun.cli import main
from hyperdryrun.trace.blocks import Category
from tests.viz.conftest import csv_blocks, live_at


@pytest.fixture(scope="module")
def page(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html") / "report.html"
    assert main(["report", str(run_dir), "--html", str(out)]) == 0
    return out


def page_json(path: Path) -> dict:
    m = re.search(r'<script id="hdr-data" type="application/json">(.*?)</script>', path.read_text(), re.S)
    return json.loads(m[1])


class _Resources(HTMLParser):
    """Every URL the page would load: script src, link href, img/iframe/source src, CSS url()."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if a.get(key) and tag in ("script", "link", "img", "iframe", "source", "embed", "object"):
                self.urls.append(a[key] or "")


def test_the_page_loads_nothing_from_outside(page: Path) -> None:
    text = page.read_text()
    parser = _Resources()
    parser.feed(text)
    assert parser.scripts == 3  # data, uPlot, the page's code: all inline
    assert parser.urls == ["data:,"]  # the empty favicon, so the browser asks for none
    styles = re.findall(r"<style>(.*?)</style>", text, re.S)
    assert styles and not any(re.search(r"url\((?!['\"]?data:)", s) for s in styles)
    assert "@import" not in "".join(styles)
    assert "Copyright (c) 2022 Leon Sorokin" in text  # uPlot's MIT licence travels with it


def test_the_page_carries_every_block_and_the_timeline_of_each_category(page: Path, run_dir: Path) -> None:
    """Expanded from its change points, each category's series is the bytes of the CSV's blocks of that category
    alive at each task (counted here from the CSV rows alone)."""
    data = page_json(page)
    assert [s["label"] for s in data["sides"]] == ["rank 0", "rank 1"]
    side = data["sides"][0]
    report = json.loads((run_dir / "rank_0" / "rank_0_memory.json").read_text())
    rows = csv_blocks(run_dir / "rank_0" / "rank_0_memory.csv")
    assert side["summary"] == report["summary"]
    assert sorted(side["blocks"]["size"]) == sorted(int(r["size"]) for r in rows)
    tl = side["timeline"]
    n = tl["n"]
    assert n == report["summary"]["num_tasks"]
    for cat in Category:
        tasks, values = tl["cats"][str(cat)]
        series, k, cur = [], 0, 0
        for t in range(n):
            while k < len(tasks) and tasks[k] <= t:
                cur, k = values[k], k + 1
            series.append(cur)
        for t in range(0, n, 7):
            expected = sum(int(r["size"]) for r in live_at(rows, t) if r["type"] == str(cat))
            assert series[t] == expected, (cat, t)
    assert [c["name"] for c in data["categories"]] == [str(c) for c in Category]


def test_a_report_without_its_csv_draws_its_own_live_set(rank0_json: Path, tmp_path: Path) -> None:
    lone = tmp_path / "lone.json"
    lone.write_text(rank0_json.read_text())
    out = tmp_path / "lone.html"
    assert main(["report", str(lone), "--html", str(out)]) == 0
    side = page_json(out)["sides"][0]
    report = json.loads(rank0_json.read_text())
    assert side["timeline"] is None and side["blocksScope"] == "peak"
    assert side["blocks"]["id"] == [b["id"] for b in report["peak_live_set"]["blocks"]]


def test_report_defaults_to_report_html_in_the_output_dir(run_dir: Path, capsys) -> None:
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"wrote {run_dir / 'report.html'}\n"
    assert (run_dir / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_bad_inputs_are_one_line_errors(tmp_path: Path, run_dir: Path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"hyperdryrun: error: {tmp_path}: no rank_<r>/rank_<r>_memory.json or .csv under it\n"
    assert main(["report", str(run_dir), "--compare", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compare draws one rank on each side" in err
    (tmp_path / "junk.json").write_text("{}")
    assert main(["report", str(tmp_path / "junk.json")]) == 2
    assert "JSON that is neither a HyperDryRun report nor a Chrome trace" in capsys.readouterr().err
