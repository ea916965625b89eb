"""The planner's unit: elements per local token, by dtype class (`Counts`), and the byte size
of each class under a run's dtypes (`Dtypes`).

Every per-layer formula (`flashcp.plan.activations`, `moe_rows`, `attention_scratch`) counts
*elements per local token* of one micro-batch, each in the dtype class the tensor has, so one
count serves every precision:

* ``f``: always float32 — RMSNorm's normalised input and its rsqrt, LayerNorm's mean/var, the
  attention LSE, the MoE router (it computes in float32, `flashcp.models.moe`);
* ``res``: the residual stream and norm outputs — float32 by default: O1 autocast keeps them
  float32, and with bf16 storage the embedding outputs float32 and norms return their input's
  dtype (`flashcp.models.layers`), so pipeline stages exchange float32 too; a bfloat16
  residual stream (`flashcp.plan.features`) makes the whole class bfloat16;
* ``c``: the compute dtype (train.dtype resolved: bf16 on GPU, float32 on CPU) — matmul
  outputs: q/k/v projections, rotated q/k, the attention output, MLP intermediates;
* ``e``: the routed experts' rows (`flashcp.models.experts.GroupedExperts.row_dtype`): the
  grouped matmuls' saved inputs, the dispatched and returned buffers (the all-to-all under
  expert parallelism) and the expert outputs the combine keeps — on CPU the activations' dtype
  (float32), on GPU the stored weights' dtype (train.param_dtype: Paddle's grouped GEMM
  computes in it, so the MoE layer casts its rows before dispatch). LoRA-adapted experts take
  float32 rows (their adapters are float32): their buffers count in ``res``;
* ``b``: the residual stream between layers (`model.residual_dtype`).

int64 tensors (the MoE router's choices and buffer slots) count as two float32 elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counts:
    """Elements per token by dtype class (``f``, ``res``, ``c``), with what each counts."""

    f: float = 0.0
    res: float = 0.0
    c: float = 0.0
    e: float = 0.0
    b: float = 0.0
    parts: list[tuple[str, str, float]] = field(default_factory=list)

    def add(self, what: str, cls: str, n: float) -> Counts:
        setattr(self, cls, getattr(self, cls) + n)
        self.parts.append((what, cls, n))
        return self

    def bytes(self, dt: Dtypes) -> float:
        """Bytes per token for the dtype sizes `dt`."""
        return (
            self.f * 4 + self.res * dt.res + self.c * dt.c + self.e * dt.experts
            + self.b * dt.boundary
        )  # fmt: skip

    def __add__(self, other: Counts) -> Counts:
        out = Counts(self.f, self.res, self.c, self.e, self.b, [*self.parts])
        for what, cls, n in other.parts:
            out.add(what, cls, n)
        return out


@dataclass(frozen=True)
class Dtypes:
    """Byte sizes: `c` compute dtype, `res` the residual stream inside a layer, `param`
    parameter storage, `experts` the routed experts' rows (class ``e``), `boundary` the
    residual stream between layers (`model.residual_dtype`); `gpu`: the device is a GPU."""

    c: int
    res: int
    param: int
    experts: int = 4
    gpu: bool = False
    boundary: int = 4

    @classmethod
    def of(
        cls, compute: str, param_dtype: str, device: str = "cpu", residual: str = "float32"
    ) -> Dtypes:
        """`residual`: the residual stream's dtype, "float32" (today) or "bfloat16"
        (`flashcp.plan.features`)."""
        c = 2 if compute == "bfloat16" else 4
        p = 2 if param_dtype == "bfloat16" else 4
        gpu = device == "gpu"
        sizes = {"float32": 4, "bfloat16": 2}
        if residual not in sizes:
            raise ValueError(f"residual dtype {residual!r}: use one of {sorted(sizes)}")
        # GPU: Paddle's grouped GEMM computes in the weights' dtype; CPU: batched matmuls on
        # the float32 activations, the weights upcast chunk by chunk. A layer upcasts a
        # bf16 stream on entry: inside it the residual class stays float32.
        return cls(c=c, res=4, param=p, experts=p if gpu else 4, gpu=gpu,
                   boundary=sizes[residual])  # fmt: skip

    @property
    def numpy_elementwise(self) -> bool:
        """CPU float32 compute: RMSNorm and rotary run as numpy PyLayers
        (`flashcp.models.cpu_elementwise`), which save only what their backward reads (the
        normalised input; the cos/sin tables), not their inputs as Paddle's ops do."""
        return not self.gpu and self.c == 4

    def numpy_rmsnorm(self, norm: str) -> bool:
        """Whether a norm of kind `norm` (``rms`` or ``layer``) is the numpy RMSNorm of
        `numpy_elementwise`: it keeps no input, so nothing keeps a tensor only it read."""
        return self.numpy_elementwise and norm == "rms"

    @property
    def autocast(self) -> bool:
        """bf16 O1 autocast: matmuls cast their float32 inputs (and float32 weights) to bf16
        and save those copies for backward."""
        return self.c < 4

    @property
    def upcast(self) -> bool:
        """bf16 storage with float32 compute (CPU): each matmul upcasts its weight without
        saving the copy (`flashcp.models.precision.cast_linear`), so copies are transient."""
        return self.param < self.c
