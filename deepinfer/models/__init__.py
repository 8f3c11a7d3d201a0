"""DeepSeek model code, written only against the backend contract."""
