"""A reverse-mode autograd engine over an explicit graph, computing through a pluggable executor.

Tensors hold executor handles plus shape/dtype metadata; every op is a Function whose backward sits next to its
forward and is written with Tensor ops, so create_graph=True differentiates the backward pass itself. The
BackwardPass walks the graph iteratively in reverse topological order; the NumpyExecutor computes locally, and an
executor that emits commands to a remote worker plugs in through the same Executor interface.
"""

from simdist.autograd import dispatch, ops
from simdist.autograd import tensor as _tensor_module
from simdist.autograd.backward import BackwardPass
from simdist.autograd.errors import (
    AutogradError,
    BackwardError,
    ExecutorError,
    GradcheckError,
    GraphCycleError,
    GraphReleasedError,
    NonDifferentiableError,
    ShapeError,
)
from simdist.autograd.executor import (
    INSTRUCTIONS,
    Executor,
    TensorMeta,
    current_executor,
    set_default_executor,
    use_executor,
)
from simdist.autograd.factories import full, full_like, ones, ones_like, tensor, zeros, zeros_like
from simdist.autograd.function import Function
from simdist.autograd.grad_mode import enable_grad, in_backward, is_grad_enabled, no_grad, set_grad_enabled
from simdist.autograd.gradcheck import GradientComputer, gradcheck, numerical_gradient
from simdist.autograd.graph import Graph, Node, current_graph, default_graph
from simdist.autograd.numpy_executor import NumpyExecutor
from simdist.autograd.ops import cat, chunk, split, sum_to, where
from simdist.autograd.tensor import Tensor

# Tensor's methods call the ops and the backward pass, which build on Tensor: bound here, once all exist.
_tensor_module.bind(ops, dispatch, BackwardPass)
set_default_executor(NumpyExecutor())

__all__ = [
    "INSTRUCTIONS",
    "AutogradError",
    "BackwardError",
    "BackwardPass",
    "Executor",
    "ExecutorError",
    "Function",
    "GradcheckError",
    "GradientComputer",
    "Graph",
    "GraphCycleError",
    "GraphReleasedError",
    "Node",
    "NonDifferentiableError",
    "NumpyExecutor",
    "ShapeError",
    "Tensor",
    "TensorMeta",
    "cat",
    "chunk",
    "current_executor",
    "current_graph",
    "default_graph",
    "enable_grad",
    "full",
    "full_like",
    "gradcheck",
    "in_backward",
    "is_grad_enabled",
    "no_grad",
    "numerical_gradient",
    "ones",
    "ones_like",
    "set_default_executor",
    "set_grad_enabled",
    "split",
    "sum_to",
    "tensor",
    "use_executor",
    "where",
    "zeros",
    "zeros_like",
]
