"""The client's input dtypes (`client.generate.DTYPES`) are the ensemble's: a name missing
there would be sent as BYTES and refused by the server."""

from __future__ import annotations

from pathlib import Path

from backend.triton.bls import read_config
from client.generate import DTYPES

ROOT = Path(__file__).resolve().parents[2]
WIRE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT64": "UINT64",
        "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}


def test_every_ensemble_input_has_its_dtype_in_the_client():
    config = read_config(ROOT / "model_repo" / "ensemble" / "config.pbtxt")
    served = {i["name"]: WIRE[i["data_type"]] for i in config["input"]}
    assert {name: DTYPES.get(name, "BYTES") for name in served} == served
    assert set(DTYPES) <= set(served)
