"""The committed gRPC stubs match what grpc_tools.protoc generates from protos/ now."""

from __future__ import annotations

import filecmp
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    protos = sorted((ROOT / "protos" / "recserve" / "v1").glob("*.proto"))
    assert len(protos) >= 5
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}"]
        + [str(p) for p in protos]
    )
    assert rc == 0
    generated = sorted(p.name for p in (tmp_path / "recserve" / "v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "recserve" / "v1").iterdir() if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert generated == committed, "run `make protos` and commit the result"
    stale = [n for n in generated if not filecmp.cmp(tmp_path / "recserve" / "v1" / n, ROOT / "recserve" / "v1" / n, shallow=False)]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit the result"
