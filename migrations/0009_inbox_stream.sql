-- The events stream a parked message waits in. One durable name may consume
-- several streams (one process each); the stream sequence of a parked row
-- means something only in its own stream, so each finds only its own.
-- Rows parked before this column existed (NULL) are taken by any.
ALTER TABLE inbox_messages ADD COLUMN IF NOT EXISTS stream text;
