"""A fake causal LM whose log-probs shift by hand-known amounts once a marker token has been read: the hindsight
shift of HDL's branch points (tests/test_method_hdl.py) and SEED's skill contexts (tests/test_method_seed.py)."""

import math

import torch

V = 40


LN20, LN40_78 = math.log(20.0), math.log(40.0 / 78.0)


class HindsightModel(torch.nn.Module):
    """Fake causal LM over 40 tokens: uniform, except that once a *marker* token (id >= 24) has been
    read, the position after a 7 puts logit ln 39 on token 6 (p(6) = 1/2, every other token 1/78).

    So a context that starts with a marker shifts ``log p(y_t)`` by ``ln 20`` (y_t = 6) or
    ``ln(40/78)`` (else) exactly where ``y_{t-1} = 7``, and by 0 everywhere else.
    """

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        B, T = input_ids.shape
        seen = ((input_ids >= 24) & (attention_mask > 0 if attention_mask is not None else True)).long().cumsum(-1) > 0
        logits = torch.zeros(B, T, V)
        logits[..., 6] = torch.where(seen & (input_ids == 7), torch.tensor(math.log(39.0)), torch.tensor(0.0))

        class O:
            pass

        o = O()
        o.logits = logits
        return o
