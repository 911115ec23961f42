-- The relay's least-privilege role (docs/configuration.md, "Postgres privileges"),
-- run by docker-compose.yml after `outbox-relay migrate`, as the table's owner.
-- Idempotent. Use a real secret instead of the demo password.
DO $$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_relay') THEN
    CREATE ROLE outbox_relay LOGIN REPLICATION PASSWORD 'relay';
  END IF;
  IF NOT EXISTS (SELECT FROM pg_publication WHERE pubname = 'outbox_relay_demo') THEN
    CREATE PUBLICATION outbox_relay_demo FOR TABLE public.outbox_events WITH (publish = 'insert', publish_via_partition_root = true);
  END IF;
  -- The one the relay streams through, so that an edit of the one above
  -- loses nothing (docs/guide/outbox-tables.md, "The publication the relay keeps").
  IF NOT EXISTS (SELECT FROM pg_publication WHERE pubname = 'outbox_relay_demo_keep') THEN
    CREATE PUBLICATION outbox_relay_demo_keep FOR TABLE public.outbox_events WITH (publish = 'insert', publish_via_partition_root = true);
  END IF;
END
$$;
-- Say from which WAL position it publishes the outbox (the relay, which may
-- not comment it, streams through it only then). The position must come
-- after the commit that made it: run in a transaction of its own, this
-- does nothing (but say so) in the transaction that made it.
DO $$
DECLARE
  m text;
BEGIN
  SELECT pr.oid::text INTO m
  FROM pg_publication p JOIN pg_publication_rel pr ON pr.prpubid = p.oid
  WHERE p.pubname = 'outbox_relay_demo_keep' AND pr.prrelid = 'public.outbox_events'::regclass
    AND pr.xmin <> (txid_current() % 4294967296)::text::xid;
  IF m IS NULL THEN
    RAISE NOTICE 'outbox_relay_demo_keep: run this block again in a transaction of its own';
  ELSIF coalesce(obj_description((SELECT oid FROM pg_publication WHERE pubname = 'outbox_relay_demo_keep'), 'pg_publication'), '') NOT LIKE '%; membership ' || m || ';%' THEN
    EXECUTE format('COMMENT ON PUBLICATION outbox_relay_demo_keep IS %L',
      'outbox-relay: slot outbox_relay_demo streams the inserts of public.outbox_events through this publication, so that an edit of --publication loses nothing; membership '
      || m || '; in the slot from WAL position ' || pg_current_wal_insert_lsn()
      || '. Drop it only with the relay stopped (it is made again); never add the table back by hand');
  END IF;
END
$$;
GRANT SELECT ON public.outbox_events TO outbox_relay;
