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
GRANT SELECT ON public.outbox_events TO outbox_relay;
