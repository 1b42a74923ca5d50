"""Regenerate the Python stubs of proto/gyre/v1/*.proto into gyre/v1/ (the only way to make them).

Usage: python scripts/gen_proto.py [--out DIR]   (DIR defaults to the repository root)

The generated modules import each other as `gyre.v1.<name>_pb2`, so they live inside the `gyre`
package. tests/test_contracts.py regenerates into a temporary directory and fails if the committed
stubs differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto file under `out`/gyre/v1."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "gyre" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    (out / "gyre" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed: see the messages above")
    init = out / "gyre" / "v1" / "__init__.py"
    init.write_text(
        '"""Generated protobuf and gRPC stubs of proto/gyre/v1 (scripts/gen_proto.py). Do not edit."""\n'
    )
    return sorted((out / "gyre" / "v1").glob("*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    files = generate(args.out)
    print(f"generated {len(files)} files under {args.out / 'gyre' / 'v1'}", file=sys.stderr)


if __name__ == "__main__":
    main()
