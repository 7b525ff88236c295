"""`vllm.entrypoints.cli.main`: the `vllm` command, as pip's console script runs it (`main()`)."""

import vllm.entrypoints.cli.serve
from rankguard_sim.fake_vllm import cli


def main() -> None:
    """vLLM's main: the serve subcommand's parser, sys.argv parsed, `cmd.validate`, dispatch."""
    cli.main(vllm.entrypoints.cli.serve.cmd_init)


if __name__ == "__main__":
    main()
