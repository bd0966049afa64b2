"""The local Ray a run starts (``relax.infra.control.controller.start_local_ray``)."""

from relax.infra.control.controller import RAY_IDLE_CONFIG


def test_the_local_ray_runs_with_relax_system_settings(local_ray):
    """Ray metrics off, as the GCS holds them (what its daemons and workers read), and
    the constant left as it is (ray.init adds keys to the dict it is given)."""
    import ray

    config = ray._private.state.state.get_system_config()
    assert RAY_IDLE_CONFIG == {"enable_metrics_collection": False, "event_stats": False}
    assert {k: config.get(k) for k in RAY_IDLE_CONFIG} == RAY_IDLE_CONFIG
