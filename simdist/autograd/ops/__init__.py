"""The ops: each a Function whose backward sits next to its forward, plus functional helpers."""

from simdist.autograd.ops.arithmetic import Add, Div, Mul, Neg, Pow, PowScalar, Sub
from simdist.autograd.ops.compare import Where, compare, logical_and, where
from simdist.autograd.ops.linalg import Matmul
from simdist.autograd.ops.reduce import Expand, Mean, Sum, sum_to
from simdist.autograd.ops.shape import Cast, Permute, Reshape
from simdist.autograd.ops.split import Cat, Split, cat, chunk, split
from simdist.autograd.ops.unary import Exp, Log, Relu, Sigmoid, Tanh

__all__ = [
    "Add",
    "Cast",
    "Cat",
    "Div",
    "Exp",
    "Expand",
    "Log",
    "Matmul",
    "Mean",
    "Mul",
    "Neg",
    "Permute",
    "Pow",
    "PowScalar",
    "Relu",
    "Reshape",
    "Sigmoid",
    "Split",
    "Sub",
    "Sum",
    "Tanh",
    "Where",
    "cat",
    "chunk",
    "compare",
    "logical_and",
    "split",
    "sum_to",
    "where",
]
