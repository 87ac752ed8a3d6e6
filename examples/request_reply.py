"""Request/reply over a temporary queue.

Run: python examples/request_reply.py [FAILOVER_URL]   (no URL: the bundled pair, AMQP)

The requester creates a temporary queue (it lives as long as its connection, and is
recreated under the same name after a failover, F5) and sends each request with reply_to
pointing at it; a responder on another connection answers to reply_to, with the request's
correlation id. (On STOMP the bundled pair scopes a temporary queue to its connection,
so a reply from another connection does not arrive: a known defect.)
"""

from __future__ import annotations

import sys
import threading

from _pair import failover_url

import hafailover
from hafailover import AckMode, Message

REQUESTS = "queue://example.requests"


def responder(url: str, ready: threading.Event, done: threading.Event) -> None:
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.AUTO)
        consumer = session.create_consumer(REQUESTS)
        replies = session.create_producer()
        connection.start()
        ready.set()
        while not done.is_set():
            request = consumer.receive(timeout=0.2)
            if request is None or request.reply_to is None:
                continue
            replies.send(
                Message(body=request.text.upper(), correlation_id=request.correlation_id),
                destination=request.reply_to,
            )


def main(argv: list[str]) -> int:
    questions = ["ping", "status", "version"]
    with failover_url(argv, "amqp") as url:
        ready, done = threading.Event(), threading.Event()
        thread = threading.Thread(target=responder, args=(url, ready, done))
        thread.start()
        ready.wait(10)
        with hafailover.connect(url) as connection:
            session = connection.create_session(AckMode.AUTO)
            reply_queue = session.create_temporary_queue()
            answers = session.create_consumer(reply_queue)
            requests = session.create_producer(REQUESTS)
            connection.start()
            print(f"replies come to {reply_queue}")
            ok = True
            for number, question in enumerate(questions):
                requests.send(
                    Message(body=question, reply_to=reply_queue, correlation_id=f"q{number}")
                )
                reply = answers.receive(timeout=5.0)
                if reply is None:
                    print(f"{question} -> no reply")
                    ok = False
                    break
                print(f"{question} -> {reply.text} (correlation id {reply.correlation_id})")
                ok = ok and reply.correlation_id == f"q{number}"
        done.set()
        thread.join(15)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
