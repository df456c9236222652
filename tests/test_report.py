"""The run report's curves: written as SVG by report.py itself."""

from xml.etree import ElementTree

from recipe.reporting.report import plot_history

SVG = "{http://www.w3.org/2000/svg}"


def test_curves_take_a_log_scale_when_the_loss_falls_more_than_20_fold(tmp_path):
    def middle_loss_label(losses):
        history = [{"step": step, "loss": loss, "learning_rate": 1e-3} for step, loss in enumerate(losses, 1)]
        svg = ElementTree.parse(plot_history(history, tmp_path / "curves.svg")).getroot()
        loss_chart = svg.findall(f"{SVG}g")[0]
        labels = [text.text for text in loss_chart.findall(f"{SVG}text") if text.get("text-anchor") == "end"]
        return labels[1]  # the y ticks: bottom, middle, top

    assert middle_loss_label([100.0, 10.0, 1.0]) == "10"  # log scale: the middle is the geometric mean
    assert middle_loss_label([3.0, 2.0, 1.0]) == "2"


def test_a_run_shorter_than_its_logging_interval_still_gets_its_charts(tmp_path):
    svg = ElementTree.parse(plot_history([{"step": 1, "train_runtime": 1.0}], tmp_path / "curves.svg")).getroot()
    assert len(svg.findall(f"{SVG}g")) == 2 and not svg.findall(f".//{SVG}polyline")
