"""Tiny random transformers Janus models (shared by tests/models/hf/test_hf_janus.py and the
training scripts' tests)."""
import torch
from transformers import JanusConfig, JanusForConditionalGeneration

BOS, PAD, BOI = 1, 0, 3
V = 32   # image codebook


def tiny_janus(patches=4, seed=0, layers=2):
    """A Janus whose grid is patches x patches (image_size / patch_size), VQ up-sampling 2."""
    torch.manual_seed(seed)
    cfg = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8 * patches,
                           patch_size=8, projection_dim=32, num_image_tokens=patches * patches),
        vq_config=dict(embed_dim=8, num_embeddings=V, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32),
    )
    m = JanusForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.startswith("model.vqmodel"):
                p.normal_(0, 0.3)   # far from the tiny init, so that every token matters
    m.generation_config.bos_token_id = BOS
    m.generation_config.pad_token_id = PAD
    m.generation_config.generation_kwargs = {"boi_token_id": BOI}
    m.generation_config._from_model_config = False   # saved and reloaded as a checkpoint's own
    return m


PROMPTS = [torch.tensor([BOS, 9, 12, 7, 20, BOI]), torch.tensor([BOS, 30, 5, BOI])]


#: the tiny processor's text: one token per character, after Janus's special tokens
CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,:"
#: a chat template of Janus-Pro's shape (a user turn, then the assistant's turn opened), in characters
CHAT_TEMPLATE = ("{% for m in messages %}<bos>u: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
                 "{% endfor %}{% if add_generation_prompt %} a:{% endif %}")


def tiny_processor(chat_template: bool = False):
    """A JanusProcessor over a character-level tokenizer whose ids fit `tiny_janus`'s text
    vocabulary (PAD, BOS, BOI as its generation config has them); `chat_template`: with
    `CHAT_TEMPLATE`, as Janus-Pro's processors carry one."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import JanusImageProcessor, JanusProcessor, PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": 2, "<begin_of_image>": BOI, "<end_of_image>": 4,
             "<image_placeholder>": 5}
    vocab.update({ch: 6 + i for i, ch in enumerate(CHARACTERS)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"})
    processor = JanusProcessor(image_processor=JanusImageProcessor(), tokenizer=tokenizer,
                               use_default_system_prompt=False)
    if chat_template:
        processor.chat_template = CHAT_TEMPLATE
    return processor
