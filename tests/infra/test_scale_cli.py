"""``relax scale`` when there is no live run to ask: one line and exit 1, no traceback."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from relax.infra.cli.app import app
from relax.streams.ports import free_port


def test_scale_of_a_run_whose_api_is_gone_says_the_run_has_ended(tmp_path):
    run_dir = tmp_path / "gone"
    run_dir.mkdir()
    (run_dir / "api_token").write_text("t")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there any more
    (run_dir / "api.json").write_text(json.dumps({"url": url,
                                                  "token_file": str(run_dir / "api_token")}))
    res = CliRunner().invoke(app, ["scale", "gone", "--instances", "2",
                                   "--run-root", str(tmp_path)])
    assert res.exit_code == 1
    assert "error: the control API of gone does not answer" in res.output
    assert "Traceback" not in res.output and res.exception.__class__ is SystemExit


def test_scale_of_a_folder_without_a_control_api_names_the_missing_file(tmp_path):
    (tmp_path / "never").mkdir()
    res = CliRunner().invoke(app, ["scale", "never", "--instances", "2",
                                   "--run-root", str(tmp_path)])
    assert res.exit_code == 1
    assert "api.json is missing" in res.output and "not running here" in res.output
