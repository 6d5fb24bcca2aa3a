"""The Gradio playground: one module per page, plus pure record -> figure/HTML renderers."""
