"""PNG plots: files a person can read, whose bars and areas are drawn from the report's own numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hyperdryrun.trace.blocks import Category
from hyperdryrun.viz import load_output_dir
from hyperdryrun.viz.style import CATEGORY_COLORS
from tests.viz.conftest import need

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plots(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need("matplotlib", "PNG plots")
    from hyperdryrun.viz.plots import write_plots

    out = tmp_path_factory.mktemp("plots")
    return {p.name: p for p in write_plots(load_output_dir(run_dir), out)}


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def _image(path: Path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_every_rank_gets_a_timeline_and_a_breakdown_and_the_ranks_share_one_axis(
    plots: dict[str, Path],
) -> None:
    assert sorted(plots) == [
        "breakdown_rank_0.png",
        "breakdown_rank_1.png",
        "ranks.png",
        "timeline_rank_0.png",
        "timeline_rank_1.png",
    ]
    for p in plots.values():
        assert p.read_bytes()[:8] == PNG_MAGIC
    assert _image(plots["timeline_rank_0.png"]).size == (1210, 506)  # 11 x 4.6 inches at 110 dpi


def test_the_timeline_shows_each_category_in_its_colour(plots: dict[str, Path], run_dir: Path) -> None:
    import json

    report = json.loads((run_dir / "rank_0" / "rank_0_memory.json").read_text())
    colors = {rgb for _, rgb in _image(plots["timeline_rank_0.png"]).getcolors(1 << 24)}
    for cat, nbytes in report["summary"]["breakdown_at_peak"].items():
        if nbytes > report["summary"]["peak_bytes"] // 50:  # wide enough to be a visible band
            assert _rgb(CATEGORY_COLORS[Category(cat)]) in colors, cat


def test_breakdown_bars_are_as_long_as_the_bytes_they_stand_for(
    plots: dict[str, Path], run_dir: Path
) -> None:
    """Measured in pixels: the Activation bar over the Parameter bar is the ratio of their bytes at the peak."""
    import json

    s = json.loads((run_dir / "rank_0" / "rank_0_memory.json").read_text())["summary"]["breakdown_at_peak"]
    img = _image(plots["breakdown_rank_0.png"])

    def bar_width(cat: Category) -> int:
        rgb = _rgb(CATEGORY_COLORS[cat])
        return max(sum(1 for x in range(img.width) if img.getpixel((x, y)) == rgb) for y in range(img.height))

    act, par = bar_width(Category.ACTIVATION), bar_width(Category.PARAMETER)
    assert par > 5
    assert act / par == pytest.approx(s["Activation"] / s["Parameter"], rel=0.05)


def test_without_matplotlib_plots_are_a_one_line_error_naming_the_extra(monkeypatch, run_dir: Path) -> None:
    from hyperdryrun.viz.plots import MissingExtra, write_plots

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes `import matplotlib.figure` fail
    with pytest.raises(
        MissingExtra, match=r"^PNG plots need matplotlib, .*pip install 'hyperdryrun\[viz\]'$"
    ):
        write_plots(load_output_dir(run_dir), run_dir / "never")
    assert not (run_dir / "never").exists()


def test_report_plot_writes_the_page_and_the_pngs(run_dir: Path, tmp_path: Path, capsys) -> None:
    need("matplotlib", "PNG plots")
    from hyperdryrun.cli import main

    html = tmp_path / "r.html"
    assert main(["report", str(run_dir), "--html", str(html), "--plot", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {html}" and len(out) == 6
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == sorted(
        [
            "timeline_rank_0.png",
            "timeline_rank_1.png",
            "breakdown_rank_0.png",
            "breakdown_rank_1.png",
            "ranks.png",
        ]
    )


def test_report_plot_without_matplotlib_writes_nothing(
    monkeypatch, run_dir: Path, tmp_path: Path, capsys
) -> None:
    from hyperdryrun.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(run_dir), "--html", str(tmp_path / "r.html"), "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "hyperdryrun: error: PNG plots need matplotlib, which is not installed: pip install 'hyperdryrun[viz]'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_reserved_line_is_drawn_in_its_colour(run_dir: Path, tmp_path: Path) -> None:
    need("matplotlib", "PNG plots")
    from hyperdryrun.trace.blocks import live_bytes_by_task
    from hyperdryrun.viz import load_side
    from hyperdryrun.viz.plots import timeline_png
    from hyperdryrun.viz.style import RESERVED_COLOR

    side = load_side(run_dir / "rank_0" / "rank_0_memory.json")
    live = live_bytes_by_task(side.trace.blocks, side.trace.num_tasks)
    assert side.series  # a cuda dry run's report gets its allocator replay's lines on loading
    side.series = {}
    plain = tmp_path / "plain.png"
    plain.write_bytes(timeline_png(side))
    side.series = {"reserved": [v + (1 << 20) for v in live]}
    lined = tmp_path / "lined.png"
    lined.write_bytes(timeline_png(side))
    colours = {rgb for _, rgb in _image(lined).getcolors(1 << 24)}
    assert _rgb(RESERVED_COLOR) in colours
    assert _rgb(RESERVED_COLOR) not in {rgb for _, rgb in _image(plain).getcolors(1 << 24)}
