"""``[generation]`` and ``[topology] generators``: parsed, validated with the field and
the value named, and wired into the launchers (built, never started: no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.cluster.gateway import GatewayCluster
from recserve.cluster.generation import GENERATION_HEALTH_SERVICE, GenerationCluster
from recserve.config import default_config, loads
from recserve.config.spec import GenerationServiceConfig
from recserve.errors import ConfigError

BASE = """
[[tables]]
name = "item"
rows = 100
dim = 8
"""


def test_the_embedded_default_starts_one_generation_replica_on_a_free_port() -> None:
    cfg = default_config()
    assert cfg.generation == GenerationServiceConfig()
    assert (cfg.topology.generators, cfg.topology.ports("generator_ports", 1)) == (1, (0,))


def test_a_section_sets_the_model_pool_and_caps() -> None:
    cfg = loads(BASE + '[generation]\ncheckpoint = "ck"\nmax_seq_len = 256\nmax_new_tokens_cap = 128\nstop_token = -1\n'
                       '[topology]\ngenerators = 3\ngenerator_ports = "7400-7402"\n')  # fmt: skip
    gen = cfg.generation
    assert (gen.checkpoint, gen.max_seq_len, gen.max_new_tokens_cap, gen.stop_token) == ("ck", 256, 128, -1)
    assert cfg.topology.ports("generator_ports", 3) == (7400, 7401, 7402)


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("[generation]\nmax_new_tokens_cap = 0", "generation.max_new_tokens_cap", "0"),
        ("[generation]\nmax_new_tokens_cap = 512", "generation.max_new_tokens_cap", "512"),  # not below max_seq_len (512)
        ("[generation]\nprefill_chunk_tokens = 300", "generation.prefill_chunk_tokens", "300"),  # over token_budget (256)
        ("[generation]\ndim = 30", "generation.dim", "30"),  # not divisible by n_heads (4)
        ("[generation]\nstop_token = 259", "generation.stop_token", "259"),
        ('[generation]\ndevice = "tpu"', "generation.device", "'tpu'"),
        ("[generation]\ndefault_timeout_ms = 0.0", "generation.default_timeout_ms", "0.0"),
        ("[generation]\nmetrics_port = -2", "generation.metrics_port", "-2"),
        ("[generation]\nmax_tokens = 3", "generation.max_tokens", "3"),
        ("[topology]\ngenerators = 65", "topology.generators", "65"),
        ('[topology]\ngenerators = 3\ngenerator_ports = "7400-7401"', "topology.generator_ports", "'7400-7401'"),
        ('[topology]\ngenerator_ports = "7400"', "topology.generator_ports", "'7400'"),
    ],
)
def test_bad_values_name_the_field_and_the_value(section: str, field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        loads(BASE + section + "\n")
    assert info.value.message.startswith(f"{field} = {value} "), info.value.message


def test_no_generators_is_allowed() -> None:
    assert loads(BASE + "[topology]\ngenerators = 0\n").topology.generators == 0


def test_the_launchers_pass_the_checkpoint_ports_and_generators(tmp_path: Path) -> None:
    gen = GenerationCluster(tmp_path / "spec.toml", num_replicas=2, data_root=tmp_path, checkpoint="ck", host="127.0.0.2", ports=(7400, 7401))
    assert gen._group.first_ports == (7400, 7401) and gen._group.health_service == GENERATION_HEALTH_SERVICE
    argv = gen._command(1, 7401, tmp_path / "generation-1.port")
    assert argv[3:5] == ["generate", "serve"]
    assert [argv[argv.index(f) + 1] for f in ("--config", "--model", "--host", "--port")] == [str(tmp_path / "spec.toml"), "ck", "127.0.0.2", "7401"]
    assert "--model" not in GenerationCluster(tmp_path / "spec.toml", data_root=tmp_path)._command(0, 0, tmp_path / "p")

    gw = GatewayCluster(tmp_path / "spec.toml", ["127.0.0.1:1"], generators=["127.0.0.1:7400", "127.0.0.1:7401"], data_root=tmp_path)
    argv = gw._command(0, 0, tmp_path / "gateway-0.port")
    assert argv[argv.index("--generators") + 1] == "127.0.0.1:7400,127.0.0.1:7401"
    assert "--generators" not in GatewayCluster(tmp_path / "spec.toml", ["127.0.0.1:1"], data_root=tmp_path)._command(0, 0, tmp_path / "p")
    with pytest.raises(ConfigError, match="generators"):
        GatewayCluster(tmp_path / "spec.toml", ["127.0.0.1:1"], generators=["a:1,b:2"], data_root=tmp_path)
    with pytest.raises(ConfigError, match="num_replicas = 0"):
        GenerationCluster(tmp_path / "spec.toml", num_replicas=0, data_root=tmp_path)
