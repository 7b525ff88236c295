"""The stand-in `vllm` command's serve leaf: the one vLLM 0.33's `ServeSubcommand.cmd` ends in."""

from __future__ import annotations

import pytest

from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.fake_vllm.cli import (
    RUN_DP_SUPERVISOR,
    RUN_HEADLESS,
    RUN_MULTI_API_SERVER,
    RUN_SERVER,
    serve_route,
)


@pytest.mark.parametrize(
    ("flags", "leaf", "api_servers"),
    [
        ([], RUN_SERVER, None),  # one API server, in this process (cmd clears the count)
        (["--headless"], RUN_HEADLESS, 0),
        (["-dp", "2"], RUN_MULTI_API_SERVER, 2),  # internal load balancing: one per DP rank
        (["-dp", "2", "--data-parallel-rank", "1"], RUN_SERVER, None),  # external LB: one
        (["-dp", "4", "--data-parallel-start-rank", "2", "-dpl", "2"], RUN_MULTI_API_SERVER, 2),  # hybrid
        (["--api-server-count", "3"], RUN_MULTI_API_SERVER, 3),
        (["-dp", "2", "--data-parallel-multi-port-external-lb"], RUN_DP_SUPERVISOR, 1),
    ],
)
def test_the_leaf_and_api_server_count_are_vllms(
    flags: list[str], leaf: str, api_servers: int | None
) -> None:
    args = parse_args(["serve", "m", *flags])
    assert serve_route(args) == leaf
    assert args.api_server_count == api_servers
