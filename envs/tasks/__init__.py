"""Task sources in the visual-reasoning benchmarks' own file formats, and their metrics."""
