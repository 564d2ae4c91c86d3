"""ONNX graphs of one frozen-weight product, the weights held as initializers (what HTP keeps resident).

A QDQ graph (W8A16, W8A8) is the form QNN compiles to integer HTP kernels: QuantizeLinear/DequantizeLinear
around the activations, a DequantizeLinear over the int8 codes, a MatMul. The input-gradient graph reads the
same codes untransposed (`rows @ W`), the forward graph through a Transpose (`rows @ W^T`); QNN folds the
transpose into the kernel. An fp16 graph is a float graph that the session runs at HTP's fp16 precision.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..qdq import ACT_LEVELS, FP16_CODE_SCALE

OPSET = 21


def product_graph(
    codes: np.ndarray,
    rows: int,
    mode: str,
    contract_rows: bool,
    out_range: float,
    weight_scales: np.ndarray | None = None,
) -> onnx.ModelProto:
    """`rows` x `in` -> `rows` x `out` (forward) or `rows` x `out` -> `rows` x `in` (contract_rows) over int8
    `codes` [out, in]. `weight_scales` (per output channel) are for the forward only: the caller folds them
    into the gradient for the transposed product (see qdq.py)."""
    out_features, in_features = codes.shape
    width_in, width_out = (out_features, in_features) if contract_rows else (in_features, out_features)
    nodes, inits = [], []
    if mode == "fp16":
        inits.append(numpy_helper.from_array(codes.astype(np.float32) / FP16_CODE_SCALE, "W"))
        weights, rows_in = "W", "A"
    else:
        levels = ACT_LEVELS[mode]
        act_type, zero = (np.uint16, 32768) if mode == "w8a16" else (np.uint8, 128)
        scales = np.float32(1.0) if weight_scales is None else weight_scales.astype(np.float32)
        inits += [
            numpy_helper.from_array(codes.astype(np.int8), "codes"),
            numpy_helper.from_array(np.asarray(scales), "w_scale"),
            numpy_helper.from_array(np.zeros(np.shape(scales), np.int8), "w_zero"),
            numpy_helper.from_array(np.array(1.0 / levels, np.float32), "a_scale"),
            numpy_helper.from_array(np.array(out_range / levels, np.float32), "y_scale"),
            numpy_helper.from_array(np.array(zero, act_type), "a_zero"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["A", "a_scale", "a_zero"], ["A_q"]),
            helper.make_node("DequantizeLinear", ["A_q", "a_scale", "a_zero"], ["A_dq"]),
            helper.make_node(
                "DequantizeLinear",
                ["codes", "w_scale", "w_zero"],
                ["W"],
                **({} if weight_scales is None else {"axis": 0}),
            ),
        ]
        weights, rows_in = "W", "A_dq"
    if not contract_rows:
        nodes.append(helper.make_node("Transpose", [weights], ["W_t"], perm=[1, 0]))
        weights = "W_t"
    product = "Y" if mode == "fp16" else "Y_f"
    nodes.append(helper.make_node("MatMul", [rows_in, weights], [product]))
    if mode != "fp16":
        nodes += [
            helper.make_node("QuantizeLinear", ["Y_f", "y_scale", "a_zero"], ["Y_q"]),
            helper.make_node("DequantizeLinear", ["Y_q", "y_scale", "a_zero"], ["Y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "product",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [rows, width_in])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, width_out])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    return model
