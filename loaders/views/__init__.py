"""What a sample is, over a dataset dir: `MMapDataset` (map-style, `dataset`), its iterable twin
(`iterable`), token windows (`tokens`) and documents packed into rows (`packed`)."""
