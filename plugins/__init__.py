"""Custom operators for compiled engines: anchor capture, gated delta scan, Mamba2 (SSD) scan,
causal conv1d, mixture-of-experts routed sum.

Importing the package registers the operators (`torch.ops.suffixreplay.*`); engines built by
`engine_build/build.py --backend aot` need it imported before they load, as a TensorRT engine
needs its plugin library. References: `plugins.reference`; CPU: `plugins.cpu`; Triton:
`plugins.triton_kernels`; TensorRT plugin registration: `plugins.tensorrt`.
"""

from plugins.ops import (
    anchor_capture,
    causal_conv1d,
    gated_delta_scan,
    gated_delta_scan_snap,
    moe_experts,
    ssd_scan,
    ssd_scan_snap,
    triton_available,
)

__all__ = ["anchor_capture", "causal_conv1d", "gated_delta_scan", "gated_delta_scan_snap",
           "moe_experts", "ssd_scan", "ssd_scan_snap", "triton_available"]
