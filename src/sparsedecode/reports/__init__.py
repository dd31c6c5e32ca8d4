"""Reports of finished experiments: tables, Markdown, CSV and plots (outside the library: the library never imports
this package)."""
