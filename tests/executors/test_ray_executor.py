"""The ``ray`` executor on a real local Ray cluster (bound to 127.0.0.1, 4 logical CPUs)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray executor needs enginecore[ray]")

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.testing import ExecutorContract  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=4,  # logical: room for two 2-rank executors at once
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            object_store_memory=80 * 1024 * 1024,
        )
    yield ray
    if started:
        ray.shutdown()


class TestRayExecutorContract(ExecutorContract):
    executor = "ray"
    world_size = 2

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _cluster(cls, ray_cluster):
        return ray_cluster


def test_ray_tp2_generates_what_tp1_generates(ray_cluster, tiny_llama) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["hello world", "one two three four"]
    common = dict(dtype="float32", num_blocks_override=128, max_model_len=1024)
    with LLM(tiny_llama, multiprocessing=False, **common) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(
        tiny_llama, executor="ray", tensor_parallel_size=2, multiprocessing=False, **common
    ) as llm:
        assert llm.engine_client.ready.components["executor"].startswith("ray ")
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        pids = llm.collective_rpc("get_pid")
    assert got == want
    assert len(set(pids)) == 2
