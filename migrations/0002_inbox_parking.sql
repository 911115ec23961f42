-- Consumer parking (SPEC §6: order per aggregate without head-of-line
-- blocking). A message whose handler failed waits in its inbox row until
-- `parked_until`, acked in JetStream so it holds no ack-pending slot; later
-- messages of the same aggregate wait behind it the same way. The consumer
-- reads a parked message again from the stream by `stream_seq`.
-- Nullable columns without defaults: no table rewrite.
ALTER TABLE inbox_messages
    ADD COLUMN IF NOT EXISTS aggregate_key text   NULL,
    ADD COLUMN IF NOT EXISTS stream_seq    bigint NULL,
    ADD COLUMN IF NOT EXISTS parked_until  timestamptz NULL;
