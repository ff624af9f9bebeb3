"""Text in and out: the tokenizer (tokenizer.py), chat templates (chat_template.py, rendered in
template_renderer.py's process) and the grammars a reply follows (structured_output.py)."""
