"""The config of VarlenGPTForCausalLM (modeling_varlen_gpt.py): everything that fixes the GPT's shapes and
math, in transformers' names where it has them."""

from transformers import PretrainedConfig


class VarlenGPTConfig(PretrainedConfig):
    model_type = "varlen_gpt"

    def __init__(
        self,
        vocab_size: int = 320,
        hidden_size: int = 64,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 2,
        num_key_value_heads: int | None = None,
        head_dim: int = 32,
        layer_windows: list[int] | None = None,
        rope_base: float = 10000.0,
        logit_softcap: float = 15.0,
        rms_norm_eps: float = 2.0**-23,
        max_position_embeddings: int = 2048,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim
        # Left attention window of each layer, -1 = the whole context. Not transformers' `sliding_window`:
        # with it, its cache would drop old keys, and the full cache lets one mask serve prefill and decoding.
        self.layer_windows = list(layer_windows) if layer_windows is not None else [-1] * num_hidden_layers
        self.rope_base = rope_base
        self.logit_softcap = logit_softcap  # 0 = no cap
        self.rms_norm_eps = rms_norm_eps  # float32's machine epsilon, whatever the dtype
        self.max_position_embeddings = max_position_embeddings  # the longest document seen in training
        self.use_cache = use_cache
        # The output head has its own weights (transformers' configs tie them by default).
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
        if len(self.layer_windows) != num_hidden_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {num_hidden_layers} layers"
            )
