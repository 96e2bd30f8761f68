"""Report: ``report.md`` (`markdown`), its plots (`plots`) and the memory section (`memory`)."""
