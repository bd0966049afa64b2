"""Co-located stages share cores: BusyFlag files and the trainer's ElasticThreads."""

import pytest
import torch

from relax.trainer.cores import BusyFlag, ElasticThreads


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_busy_flag_exists_only_inside_the_block(tmp_path):
    flag = BusyFlag(tmp_path / "busy", "rollout-0")
    assert not flag.path.exists()
    with flag.busy():
        assert flag.path.exists()
    assert not flag.path.exists()
    with pytest.raises(RuntimeError), flag.busy():
        raise RuntimeError("engine failed")
    assert not flag.path.exists()  # removed on error too


def test_a_flag_left_by_a_killed_process_is_cleared_by_its_successor(tmp_path):
    (tmp_path / "rollout-0.busy").touch()
    BusyFlag(tmp_path, "rollout-0")
    assert list(tmp_path.iterdir()) == []


def test_elastic_threads_follow_the_flags(tmp_path, restore_threads):
    et = ElasticThreads(tmp_path / "busy", low=1, high=2, interval_s=0.0)
    assert et.update() == 2 and torch.get_num_threads() == 2  # no folder yet: alone
    flag = BusyFlag(tmp_path / "busy", "rollout-0")
    with flag.busy():
        assert et.update() == 1 and torch.get_num_threads() == 1
    assert et.update() == 2 and torch.get_num_threads() == 2
    assert et.switches == 2
    assert et.seconds_at(1) > 0 and et.seconds_at(2) > 0


def test_only_flags_of_the_same_host_count(tmp_path, restore_threads, monkeypatch):
    """The run folder may be shared by hosts: a rollout on host b flags b's folder,
    which the trainer on host a never reads."""
    import ray

    from relax.trainer.cores import host_folder, node_address

    # outside Ray (the session's shared local Ray may be up in this process: local_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert node_address() == "127.0.0.1"
    assert host_folder(tmp_path) == tmp_path / "127.0.0.1"
    assert host_folder(tmp_path, "fe80::1") == tmp_path / "fe80__1"
    on_a = ElasticThreads(host_folder(tmp_path, "10.0.0.1"), low=1, high=2, interval_s=0.0)
    with BusyFlag(host_folder(tmp_path, "10.0.0.2"), "rollout-0").busy():
        assert on_a.update() == 2  # b is busy: a's trainer takes both cores
        with BusyFlag(host_folder(tmp_path, "10.0.0.1"), "rollout-1").busy():
            assert on_a.update() == 1


def test_elastic_threads_check_at_most_every_interval(tmp_path, restore_threads):
    et = ElasticThreads(tmp_path, low=1, high=2, interval_s=3600)
    assert et.update() == 2
    (tmp_path / "x.busy").touch()
    assert et.update() == 2  # not re-checked within the interval


def test_elastic_threads_switch_inside_forward_and_backward(tmp_path, restore_threads):
    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    et = ElasticThreads(tmp_path, low=1, high=2, interval_s=0.0)
    et.install(model)
    model[2].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    model(torch.ones(2, 4)).sum().backward()
    assert seen == [2]
    (tmp_path / "rollout-0.busy").touch()
    model(torch.ones(2, 4)).sum().backward()
    assert seen == [2, 1] and et.current == 1


def test_elastic_threads_reject_bad_bounds(tmp_path):
    with pytest.raises(ValueError, match="low"):
        ElasticThreads(tmp_path, low=2, high=1)
    with pytest.raises(ValueError, match="low"):
        ElasticThreads(tmp_path, low=0, high=1)


def test_the_demo_recipe_wires_the_flags_to_rollout_and_trainer(tmp_path):
    from relax.infra.recipe import load_recipe
    from relax.infra.stages import stage_specs
    from relax.streams.client import BusConfig
    from testdata import RECIPES

    rec = load_recipe(RECIPES / "arith_grpo_smollm2.yaml", [])
    specs = {s.name: s for s in stage_specs(rec, BusConfig(bootstrap_servers="x:1"), tmp_path)}
    busy = str(tmp_path / "busy")
    assert specs["rollout-0"].config["busy_dir"] == busy
    assert specs["trainer"].config["busy_dir"] == busy
    assert specs["trainer"].config["max_threads"] == 2
    off = load_recipe(RECIPES / "arith_grpo_smollm2.yaml", ["resources.trainer.max_torch_threads=null"])
    specs = {s.name: s for s in stage_specs(off, BusConfig(bootstrap_servers="x:1"), tmp_path)}
    assert specs["rollout-0"].config["busy_dir"] is None
    assert specs["trainer"].config["max_threads"] is None


@pytest.mark.parametrize("override, message", [
    ("resources.rollout.max_torch_threads=2", "trainer only"),
    ("resources.trainer.max_torch_threads=1", None),  # equal to torch_threads: allowed
])
def test_max_torch_threads_is_checked(override, message):
    from relax.infra.recipe import RecipeError, load_recipe
    from testdata import RECIPES

    if message is None:
        load_recipe(RECIPES / "arith_grpo_smollm2.yaml", [override])
        return
    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPES / "arith_grpo_smollm2.yaml", [override])


def test_max_torch_threads_below_torch_threads_is_refused():
    from relax.infra.recipe import RecipeError, load_recipe
    from testdata import RECIPES

    with pytest.raises(RecipeError, match="below torch_threads"):
        load_recipe(RECIPES / "arith_grpo_smollm2.yaml",
                    ["resources.trainer.torch_threads=2", "resources.trainer.max_torch_threads=1"])
