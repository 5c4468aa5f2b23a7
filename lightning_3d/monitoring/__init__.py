"""What a run reports while it trains: throughput, MFU, memory probes and global model summaries
(Lightning callbacks that any LightningModule can use, with or without the strategy)."""
