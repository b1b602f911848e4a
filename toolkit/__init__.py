"""pagedkv core: quantization formats, block pool, the paged attention op, the HF compiler step."""

import logging as _logging

# torchao (pulled in by transformers/executorch) logs a warning per optional CUDA extension it
# cannot load on a CPU-only machine, and torch's pytree warns about torchao's enums: noise to users.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
